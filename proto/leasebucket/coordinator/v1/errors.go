package coordinatorv1

import (
	"fmt"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Error reasons (google.rpc.ErrorInfo) of CoordinatorService, in ErrorDomain.
const (
	ErrorDomain = "leasebucket.coordinator.v1"
	// ReasonUnknownPolicyVersion: FAILED_PRECONDITION, the coordinator does not know the request's
	// policy_version. The agent reloads its policy and applies each route's failure mode meanwhile.
	ReasonUnknownPolicyVersion = "UNKNOWN_POLICY_VERSION"
	// ReasonStoreUnavailable: UNAVAILABLE, the global store failed for the whole batch (an agent
	// cannot tell it from an unreachable coordinator, and need not: both mean the failure mode).
	ReasonStoreUnavailable = "STORE_UNAVAILABLE"
)

// UnknownPolicyVersionError is the status of a request whose policy version the coordinator does
// not know.
func UnknownPolicyVersionError(version string) error {
	return withReason(codes.FailedPrecondition, ReasonUnknownPolicyVersion,
		fmt.Sprintf("unknown policy version %q", version))
}

// StoreUnavailableError is the status of a batch the global store could not serve. The message
// is generic: clients never learn store addresses or shards.
func StoreUnavailableError() error {
	return withReason(codes.Unavailable, ReasonStoreUnavailable, "global bucket store unavailable")
}

func withReason(code codes.Code, reason, msg string) error {
	st, err := status.New(code, msg).WithDetails(&errdetails.ErrorInfo{Reason: reason, Domain: ErrorDomain})
	if err != nil { // only if the detail cannot be marshalled
		return status.Error(code, msg)
	}
	return st.Err()
}

// Reason returns the ErrorInfo reason of a CoordinatorService error, or "".
func Reason(err error) string {
	st, ok := status.FromError(err)
	if !ok {
		return ""
	}
	for _, d := range st.Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok && info.Domain == ErrorDomain {
			return info.Reason
		}
	}
	return ""
}
