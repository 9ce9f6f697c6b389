package redisstore

// Merging returns how many batches are out to Redis and how many wait to join the next round
// trip.
func (s *Store) Merging() (out, waiting int) { return s.merge.state() }
