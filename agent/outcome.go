package agent

import (
	"context"
	"errors"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	coordinatorv1 "github.com/leasebucket/leasebucket/proto/leasebucket/coordinator/v1"
)

// This file is where a shell turns a coordinator call's error into what the core needs to know
// (Classify) and decides whether to send it again (Retry). The Refresher and the simulator both
// use it; the core itself never sees a gRPC status.

// Classify reads how a call that returned err ended. nil is Answered. The coordinator's own
// refusals (invalid request, credentials, unimplemented, overloaded, the agent shutting down) were
// not applied; an unknown policy version was not applied either and asks for a reload; anything
// else (a timeout, a connection lost, the store unavailable or timing out) may have been applied.
func Classify(err error) Failure {
	switch {
	case err == nil:
		return Answered
	case errors.Is(err, ErrClosed):
		return NotApplied
	case coordinatorv1.Reason(err) == coordinatorv1.ReasonUnknownPolicyVersion:
		return UnknownPolicy
	}
	switch status.Code(err) {
	case codes.InvalidArgument, codes.FailedPrecondition, codes.PermissionDenied, codes.Unauthenticated,
		codes.Unimplemented, codes.NotFound, codes.ResourceExhausted:
		return NotApplied
	}
	return MaybeApplied
}

// Retries is how often a failed call is sent again (same request, same seq: the coordinator
// answers a repeat from its record, so nothing is charged or credited twice).
const Retries = 1

// Retry reports whether a call that failed with err on its attempt-th send (0 for the first) is
// sent again: an Acquire after a timeout (its checks may still be waiting), a Return after a
// timeout or an unavailable coordinator (gRPC already retried it on another coordinator; one more
// try after its backoff costs nothing and saves the credit).
func Retry(c *Call, attempt int, err error) bool {
	if err == nil || attempt >= Retries {
		return false
	}
	if timedOut(err) {
		return true
	}
	return c.Acquire == nil && status.Code(err) == codes.Unavailable
}

func timedOut(err error) bool {
	return status.Code(err) == codes.DeadlineExceeded || errors.Is(err, context.DeadlineExceeded)
}
