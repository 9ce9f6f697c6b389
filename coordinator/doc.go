// Package coordinator turns an agent's wish for tokens into an atomic debit of a global bucket
// and a lease. It declares the Store the buckets live behind (implemented by redisstore and
// memstore) and holds no bucket state itself, so any number of replicas serve the same keys.
package coordinator
