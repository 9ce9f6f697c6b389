package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/coordinator/redisstore"
	"github.com/leasebucket/leasebucket/internal/cli"
	"github.com/leasebucket/leasebucket/policy"
)

// oldEnvPrefix + the flag's name in upper case with '-' as '_' was the environment variable of a
// flag of the coordinator's own (LEASEBUCKET_LISTEN for --listen) until they took the command's
// name (LEASEBUCKET_COORDINATOR_LISTEN), as the agent's and the gateway's have; the old names are
// accepted, with a warning, for one release.
const oldEnvPrefix = "LEASEBUCKET_"

// Secrets come from the environment or a file, never from a flag: command lines are visible to
// every user of the host.
const (
	envRedisPassword         = "LEASEBUCKET_REDIS_PASSWORD"
	envRedisSentinelPassword = "LEASEBUCKET_REDIS_SENTINEL_PASSWORD"
)

// defaultStoreTimeout bounds a store batch: far above a Redis round trip within a region (a
// millisecond or two, tens under a latency spike), and below the agents' call timeout (500 ms by
// default), so that a slow store reaches the agent as STORE_UNAVAILABLE and not as its own
// deadline.
const defaultStoreTimeout = 300 * time.Millisecond

// Store kinds.
const (
	storeMemory = "memory"
	storeRedis  = "redis"
)

// config is everything the command line and the environment say.
type config struct {
	listen         string
	metricsListen  string
	healthListen   string
	policyFile     string
	policyInterval time.Duration

	store           string
	storeTimeout    time.Duration
	healthInterval  time.Duration
	shutdownTimeout time.Duration

	tlsCert, tlsKey, tlsClientCA string

	admins            []coordinator.Identity
	adminAuditLog     string
	overridesInterval time.Duration

	redis redisConfig

	log        cli.Logging
	deprecated []cli.Deprecation // old names used, logged at start
}

// redisConfig is how to reach Redis.
type redisConfig struct {
	addrs                []string
	cluster              bool
	masterName           string
	user, password       string
	sentinelUser         string
	sentinelPassword     string
	db                   int
	tls                  bool
	tlsCA                string
	tlsCert, tlsKey      string
	tlsServerName        string
	dialTimeout, timeout time.Duration
	poolSize             int
	inFlight             int // batches out to Redis at once (redisstore.WithInFlight)
}

const usageHeader = `Usage: coordinator --policy FILE [flags]

The leasebucket lease service in front of Redis. It grants agents leases on global token buckets:
each Acquire debits the buckets of a batch of keys atomically in Redis (one pipelined round trip
per node) and each Return credits unspent tokens back. It holds no bucket state itself, so any
number of replicas serve the same keys.

Store: --redis-addrs selects Redis (one address: standalone; several: Cluster seeds; with
--redis-master-name: the Sentinels of that master). Without it the buckets live in this
process's memory (--store=memory), which is right for a single coordinator only.

Every flag can also be set by the environment variable shown in parentheses; a flag on the
command line wins. Secrets are read from the environment or a file only:
  ` + envRedisPassword + `            password of the Redis user (or --redis-password-file)
  ` + envRedisSentinelPassword + `   password of the Sentinels (or --redis-sentinel-password-file)

Health: the gRPC health service (grpc.health.v1, for "" and "%s")
is SERVING only while the store answers a probe every --health-interval; --health-listen serves
it alone in plaintext too, for probes without a client certificate.
Shutdown: on SIGINT or SIGTERM the coordinator reports NOT_SERVING, refuses new calls, finishes
the calls in flight and exits; calls still running after --shutdown-timeout are cancelled.
Administration: the AdminService (lbctl) answers only clients whose certificate carries one of
--admin-identities, and audits every call. Runtime tenant overrides live in the store beside the
buckets; the coordinator applies them over the policy file and serves them to agents.

Flags:
`

// flags is the command's flag set and where its values land.
type flags struct {
	*cli.Flags
	cfg               config
	redisAddrs        string
	redisPassFile     string
	redisSentPassFile string
	admins            string
}

// own is the environment variable of a flag of the coordinator's own, whose old name (without
// the command's name) is still accepted.
func (f *flags) own(name string) string {
	env := envName("COORDINATOR_", name)
	f.RenameEnv(envName("", name), env)
	return env
}

// envName is LEASEBUCKET_ + infix + the flag's name in upper case with '-' as '_'.
func envName(infix, flagName string) string {
	return oldEnvPrefix + infix + strings.ToUpper(strings.ReplaceAll(flagName, "-", "_"))
}

func newFlags(getenv func(string) string, stderr io.Writer) *flags {
	f := &flags{Flags: cli.NewFlags("coordinator", fmt.Sprintf(usageHeader, coordinator.HealthService), getenv, stderr)}
	c := &f.cfg
	f.EnvString(&c.listen, "listen", f.own("listen"), ":7070", "gRPC listen `address` of the CoordinatorService and the health service")
	f.EnvString(&c.metricsListen, "metrics-listen", f.own("metrics-listen"), ":7071", "HTTP listen `address` of Prometheus /metrics; empty disables it")
	f.EnvString(&c.healthListen, "health-listen", envName("COORDINATOR_", "health-listen"), "", // new: no old name
		"`address` serving grpc.health.v1 alone, plaintext, for probes without a client certificate (a kubelet's grpc probe); default: off")
	f.EnvString(&c.policyFile, "policy", "LEASEBUCKET_POLICY", "", "policy `file` (YAML; required), reloaded when it changes")
	f.RenameEnv("LEASEBUCKET_POLICY_POLL", "LEASEBUCKET_POLICY_INTERVAL")
	f.EnvDuration(&c.policyInterval, "policy-interval", "LEASEBUCKET_POLICY_INTERVAL", policy.DefaultPollInterval, "how often the policy file is checked for changes")
	f.Rename("policy-poll", "policy-interval")
	f.EnvString(&c.store, "store", f.own("store"), "", "bucket store `kind`: redis or memory (default: redis when --redis-addrs is set, else memory)")
	f.EnvDuration(&c.storeTimeout, "store-timeout", f.own("store-timeout"), defaultStoreTimeout,
		"bound on one store batch; a batch not answered in time fails with STORE_UNAVAILABLE (keep it below the agents' call timeout)")
	f.EnvDuration(&c.healthInterval, "health-interval", f.own("health-interval"), coordinator.DefaultProbeInterval, "how often the store is probed for the health status")
	f.EnvDuration(&c.shutdownTimeout, "shutdown-timeout", f.own("shutdown-timeout"), coordinator.DefaultShutdownTimeout, "bound on the graceful shutdown")
	f.EnvString(&c.tlsCert, "tls-cert", f.own("tls-cert"), "", "server certificate `file` (PEM); serves TLS when set")
	f.EnvString(&c.tlsKey, "tls-key", f.own("tls-key"), "", "server private key `file` (PEM)")
	f.EnvString(&c.tlsClientCA, "tls-client-ca", f.own("tls-client-ca"), "", "CA `file` (PEM) of agents' client certificates: requires mutual TLS")
	f.EnvString(&f.admins, "admin-identities", envName("COORDINATOR_", "admin-identities"), "", // new: no old name
		"comma-separated client certificate `identities` allowed to call the AdminService (cn:NAME, dns:NAME, uri:URI, email:ADDRESS); needs --tls-client-ca. Empty: every admin call is refused")
	f.EnvString(&c.adminAuditLog, "admin-audit-log", envName("COORDINATOR_", "admin-audit-log"), "stderr",
		"where every admin call is audited as a JSON line: stderr (among the logs, never sampled) or a `file` (appended to)")
	f.EnvDuration(&c.overridesInterval, "overrides-interval", envName("COORDINATOR_", "overrides-interval"), coordinator.DefaultOverridesPoll,
		"how often the runtime tenant overrides are checked for changes in the store")
	redis := func(name string) string { return envName("", name) } // only the coordinator talks to Redis
	f.EnvString(&f.redisAddrs, "redis-addrs", redis("redis-addrs"), "", "comma-separated Redis `addresses` (host:port): one for standalone, several for Cluster, the Sentinels with --redis-master-name")
	f.EnvBool(&c.redis.cluster, "redis-cluster", redis("redis-cluster"), false, "treat a single --redis-addrs address as a Redis Cluster seed")
	f.EnvString(&c.redis.masterName, "redis-master-name", redis("redis-master-name"), "", "Sentinel master `name`: --redis-addrs are then the Sentinels")
	f.EnvString(&c.redis.user, "redis-user", redis("redis-user"), "", "Redis ACL `user` (default: the default user)")
	f.EnvString(&f.redisPassFile, "redis-password-file", redis("redis-password-file"), "", "`file` holding the Redis password (instead of "+envRedisPassword+")")
	f.EnvString(&c.redis.sentinelUser, "redis-sentinel-user", redis("redis-sentinel-user"), "", "ACL `user` of the Sentinels")
	f.EnvString(&f.redisSentPassFile, "redis-sentinel-password-file", redis("redis-sentinel-password-file"), "", "`file` holding the Sentinels' password (instead of "+envRedisSentinelPassword+")")
	f.EnvInt(&c.redis.db, "redis-db", redis("redis-db"), 0, "Redis database `number` (standalone and Sentinel only)")
	f.EnvBool(&c.redis.tls, "redis-tls", redis("redis-tls"), false, "connect to Redis (and the Sentinels) over TLS; implied by the other --redis-tls-* flags")
	f.EnvString(&c.redis.tlsCA, "redis-tls-ca", redis("redis-tls-ca"), "", "CA `file` (PEM) to verify Redis' certificate (default: the system's roots)")
	f.EnvString(&c.redis.tlsCert, "redis-tls-cert", redis("redis-tls-cert"), "", "client certificate `file` (PEM) for Redis servers that require one")
	f.EnvString(&c.redis.tlsKey, "redis-tls-key", redis("redis-tls-key"), "", "client private key `file` (PEM)")
	f.EnvString(&c.redis.tlsServerName, "redis-tls-server-name", redis("redis-tls-server-name"), "", "`name` expected in Redis' certificate (default: the host of each address)")
	f.EnvDuration(&c.redis.dialTimeout, "redis-dial-timeout", redis("redis-dial-timeout"), time.Second, "bound on connecting to a Redis node")
	f.EnvDuration(&c.redis.timeout, "redis-timeout", redis("redis-timeout"), time.Second, "bound on one Redis read or write (the batch's --store-timeout applies too)")
	f.EnvInt(&c.redis.poolSize, "redis-pool-size", redis("redis-pool-size"), 0, "connections per Redis node (default: go-redis', 10 per CPU)")
	f.EnvInt(&c.redis.inFlight, "redis-in-flight", redis("redis-in-flight"), redisstore.DefaultInFlight,
		"most store batches out to a standalone or Sentinel Redis at once; batches that arrive meanwhile join the next round trip. 0: no bound, one round trip per batch (always so on Cluster)")
	f.LogFlags(&c.log)
	return f
}

// parseConfig reads the environment, then the command line, and checks the result. It returns
// flag.ErrHelp when help was asked for (after printing it).
func parseConfig(args []string, getenv func(string) string, stderr io.Writer) (*config, error) {
	f := newFlags(getenv, stderr)
	if err := f.Parse(args); err != nil {
		return nil, err
	}
	if f.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments %q (see --help)", f.Args())
	}
	c := &f.cfg
	c.deprecated = f.Deprecated()
	for a := range strings.SplitSeq(f.redisAddrs, ",") {
		if a = strings.TrimSpace(a); a != "" {
			c.redis.addrs = append(c.redis.addrs, a)
		}
	}
	var err error
	if c.redis.password, err = secret(getenv, envRedisPassword, "--redis-password-file", f.redisPassFile); err != nil {
		return nil, err
	}
	if c.redis.sentinelPassword, err = secret(getenv, envRedisSentinelPassword, "--redis-sentinel-password-file", f.redisSentPassFile); err != nil {
		return nil, err
	}
	if c.admins, err = coordinator.ParseIdentities(f.admins); err != nil {
		return nil, fmt.Errorf("--admin-identities: %w", err)
	}
	r := &c.redis
	r.tls = r.tls || r.tlsCA != "" || r.tlsCert != "" || r.tlsKey != "" || r.tlsServerName != ""
	if c.store == "" {
		c.store = storeMemory
		if len(r.addrs) > 0 {
			c.store = storeRedis
		}
	}
	return c, c.check()
}

// check rejects contradictory or incomplete settings.
func (c *config) check() error {
	r := &c.redis
	redisSet := len(r.addrs) > 0 || r.cluster || r.masterName != "" || r.user != "" || r.password != "" ||
		r.sentinelUser != "" || r.sentinelPassword != "" || r.db != 0 || r.tls
	switch {
	case c.policyFile == "":
		return errors.New("--policy is required (or LEASEBUCKET_POLICY)")
	case c.store != storeMemory && c.store != storeRedis:
		return fmt.Errorf("--store=%q: want redis or memory", c.store)
	case c.store == storeMemory && redisSet:
		return errors.New("--store=memory does not use Redis: remove the Redis settings or use --store=redis")
	case c.store == storeRedis && len(r.addrs) == 0:
		return errors.New("--store=redis needs --redis-addrs")
	case r.masterName != "" && r.cluster:
		return errors.New("--redis-master-name (Sentinel) and --redis-cluster exclude each other")
	case r.db != 0 && (r.cluster || (r.masterName == "" && len(r.addrs) > 1)):
		return errors.New("--redis-db: a Redis Cluster has only database 0")
	case r.db < 0:
		return fmt.Errorf("--redis-db=%d must not be negative", r.db)
	case r.poolSize < 0:
		return fmt.Errorf("--redis-pool-size=%d must not be negative", r.poolSize)
	case r.inFlight < 0:
		return fmt.Errorf("--redis-in-flight=%d must not be negative", r.inFlight)
	case (r.tlsCert == "") != (r.tlsKey == ""):
		return errors.New("--redis-tls-cert and --redis-tls-key go together")
	case (c.tlsCert == "") != (c.tlsKey == ""):
		return errors.New("--tls-cert and --tls-key go together")
	case c.tlsClientCA != "" && c.tlsCert == "":
		return errors.New("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
	case len(c.admins) > 0 && c.tlsClientCA == "":
		return errors.New("--admin-identities needs mutual TLS (--tls-client-ca): admins are recognised by their client certificates")
	case c.adminAuditLog == "":
		return errors.New("--admin-audit-log must not be empty: stderr or a file")
	case c.listen == "":
		return errors.New("--listen must not be empty")
	}
	for name, d := range map[string]time.Duration{
		"--policy-interval": c.policyInterval, "--store-timeout": c.storeTimeout, "--health-interval": c.healthInterval,
		"--shutdown-timeout": c.shutdownTimeout, "--redis-dial-timeout": r.dialTimeout, "--redis-timeout": r.timeout,
		"--overrides-interval": c.overridesInterval,
	} {
		if d <= 0 {
			return fmt.Errorf("%s=%v must be positive", name, d)
		}
	}
	return nil
}

// secret reads a secret from the environment variable env or from file (never both), without
// the trailing newline editors and `echo` leave.
func secret(getenv func(string) string, env, fileFlag, file string) (string, error) {
	v := getenv(env)
	switch {
	case v != "" && file != "":
		return "", fmt.Errorf("%s and %s are both set: use one", env, fileFlag)
	case file == "":
		return v, nil
	}
	b, err := os.ReadFile(file)
	if err != nil {
		return "", fmt.Errorf("%s: %w", fileFlag, err)
	}
	s := strings.TrimRight(string(b), "\r\n")
	if s == "" {
		return "", fmt.Errorf("%s: %s is empty", fileFlag, file)
	}
	return s, nil
}
