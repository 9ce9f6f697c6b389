package client

// RedialFloor is how old the last retry of an unreachable agent's connection must be before a
// check retries it again.
const RedialFloor = redialFloor
