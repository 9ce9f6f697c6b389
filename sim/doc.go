// Package sim is leasebucket's simulator: a deterministic discrete-event simulation, on a virtual
// clock and one goroutine, of agents, coordinators and Redis, that runs the production code — one
// agent.Limiter per simulated agent, one coordinator.Service per region over coordinator/memstore
// stores on the virtual clock — and measures it against an ideal limiter (one exact bucket per
// identity seeing every request at once).
//
// A Scenario (YAML, docs/simulator.md) describes the fleet, the policy, the traffic and the
// failures; Run simulates it once and returns a Result (decisions, where the granted tokens went,
// the bounds I5–I7 of docs/design.md checked after every event, load on coordinators and stores, check
// latency); RunSweep runs it once per value of a parameter; PlanCapacity turns a run into a
// capacity plan with benchmark figures; WriteReport writes the Markdown report with CSV files and
// SVG plots. The same scenario and seed give the same report byte for byte.
package sim
