# leasebucket — run `make help` for the targets.
SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help
MAKEFLAGS += --no-builtin-rules

GO ?= go
# Tools are pinned and run through `go run`, so nothing needs installing.
BUF := $(GO) run github.com/bufbuild/buf/cmd/buf@v1.75.0
GOLANGCI_LINT := $(GO) run github.com/golangci/golangci-lint/v2/cmd/golangci-lint@v2.15.0
# promtool, unpacked by scripts/ensure-ops-tools.sh, for the checks of deploy/.
export PATH := $(CURDIR)/out/tools/bin:$(PATH)

.PHONY: help
help: ## Show the targets.
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  %-12s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

.PHONY: redis
redis: ## Check that redis-server is installed (installs it with apt-get when root).
	@scripts/ensure-redis.sh

.PHONY: ops-tools
ops-tools: ## Check that promtool and systemd-analyze are at hand for the checks of deploy/ (unpacks promtool from Debian's prometheus package).
	@scripts/ensure-ops-tools.sh

.PHONY: test
test: redis ops-tools ## Format check, go vet and the whole suite under the race detector, on real Redis processes; deploy/ checked with promtool and systemd-analyze.
	@unformatted=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	  if [ -n "$$unformatted" ]; then echo "gofmt needed: $$unformatted"; exit 1; fi
	$(GO) vet ./...
	$(GO) test -race -count=1 -timeout 9m ./...

.PHONY: chaos
chaos: redis ## Chaos harness on real processes: every fault on a standalone Redis and a Redis Cluster, and a broken grant rule caught; report in out/chaos.
	$(GO) test -count=1 -timeout 20m -v -run 'TestChaos|TestOverGrantingRuleIsCaught' ./internal/testkit/chaos -chaos.full -chaos.out $(CURDIR)/out/chaos

.PHONY: soak
soak: redis ## Soak: steady load and small faults for SOAK (default 30m); no process may grow; report in out/chaos/soak.
	$(GO) test -count=1 -timeout $${SOAK_TIMEOUT:-2h} -v -run TestSoak ./internal/testkit/chaos -chaos.soak $${SOAK:-30m} -chaos.out $(CURDIR)/out/chaos

.PHONY: build
build: ## Static binaries in out/bin, named as deploy/ installs them (leasebucket-agent, leasebucket-coordinator, lbpolicy, lbcheck).
	@mkdir -p out/bin
	CGO_ENABLED=0 $(GO) build -trimpath -o out/bin/leasebucket-agent ./cmd/agent
	CGO_ENABLED=0 $(GO) build -trimpath -o out/bin/leasebucket-coordinator ./cmd/coordinator
	CGO_ENABLED=0 $(GO) build -trimpath -o out/bin/lbpolicy ./cmd/lbpolicy
	CGO_ENABLED=0 $(GO) build -trimpath -o out/bin/lbcheck ./cmd/lbcheck

.PHONY: run
run: ## Run a local stack (coordinator on its in-memory store, agent, gateway on :8080, upstream) with examples/policy.yaml; Ctrl-C stops it.
	@scripts/run-local.sh

.PHONY: bench
bench: redis ## Benchmarks; figures in bench/latest.txt and bench/latest.json (format: docs/coordinator.md).
	@mkdir -p bench
	$(GO) test -run '^$$' -bench . -benchmem -count 1 -timeout 30m ./... | tee bench/latest.txt
	$(GO) run ./internal/tools/benchjson -o bench/latest.json bench/latest.txt

.PHONY: bench-stack
bench-stack: redis ## The whole-stack benchmarks alone (agent, coordinator, Redis; lease vs direct mode; one agent, then four; ~5 min); figures in bench/stack.txt.
	@mkdir -p bench
	$(GO) test -run '^$$' -bench BenchmarkStack -benchmem -count 1 -timeout 30m ./internal/testkit/stackbench | tee bench/stack.txt

.PHONY: sim
sim: ## Run the shipped simulation scenarios (examples/sim); report with plots in out/sim/report.md.
	$(GO) run ./cmd/sim -out out/sim examples/sim/*.yaml

.PHONY: lint
lint: ## go vet, golangci-lint and buf lint.
	$(GO) vet ./...
	$(GOLANGCI_LINT) run ./...
	$(BUF) lint

.PHONY: proto
proto: ## Regenerate the protobuf Go code (buf, local pinned plugins).
	$(BUF) lint
	$(BUF) generate

.PHONY: proto-check
proto-check: proto ## Fail if the committed generated code is stale.
	git diff --exit-code -- proto

.PHONY: fuzz
fuzz: ## Run every fuzz test for FUZZTIME each (default 30s).
	@for pkg in $$($(GO) list ./...); do \
	  for f in $$($(GO) test -list '^Fuzz' $$pkg | grep '^Fuzz' || true); do \
	    echo "== $$pkg $$f"; $(GO) test -run '^$$' -fuzz "^$$f$$" -fuzztime $${FUZZTIME:-30s} $$pkg; \
	  done; \
	done
