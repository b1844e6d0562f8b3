"""What the Mooncake client's integer return codes mean for a cache tier.

The Python binding returns negative ``ErrorCode`` values (mooncake-store's types.h)
instead of raising. Only the codes whose meaning matters here are named; anything
else is an error that is counted and treated as a miss.
"""

from __future__ import annotations

from enum import Enum

NO_AVAILABLE_HANDLE = -200  # no segment has room for the object
INVALID_PARAMS = -600  # e.g. the caller's buffer is smaller than the object
REPLICA_IS_NOT_READY = -703
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
OBJECT_HAS_LEASE = -706
TRANSFER_FAIL = -800  # the bytes could not be moved (a segment owner is down)
RPC_FAIL = -900  # the master did not answer
RPC_TIMEOUT = -901
UNAVAILABLE_IN_CURRENT_STATUS = -1010
TENANT_QUOTA_EXCEEDED = -1700  # the tenant is at its quota and none of its objects could be evicted
TENANT_NOT_REGISTERED = -1701  # the master's tenant quota policy has no quota for the client's tenant


class Outcome(Enum):
    OK = "ok"
    MISSING = "missing"  # an ordinary miss
    NO_SPACE = "no_space"  # a put the store rejected for space: a skipped put
    MASTER_DOWN = "master_down"  # closes the health gate
    TRANSFER = "transfer"  # one object's bytes could not be moved
    TOO_LARGE = "too_large"  # the object does not fit the buffer: not the chunk we expect
    NO_TENANT = "no_tenant"  # the master has no quota for this client's tenant: a skipped put (configuration)
    OTHER = "other"


_BY_CODE = {
    NO_AVAILABLE_HANDLE: Outcome.NO_SPACE,
    TENANT_QUOTA_EXCEEDED: Outcome.NO_SPACE,
    TENANT_NOT_REGISTERED: Outcome.NO_TENANT,
    INVALID_PARAMS: Outcome.TOO_LARGE,
    REPLICA_IS_NOT_READY: Outcome.MISSING,
    OBJECT_NOT_FOUND: Outcome.MISSING,
    OBJECT_ALREADY_EXISTS: Outcome.OK,
    TRANSFER_FAIL: Outcome.TRANSFER,
    RPC_FAIL: Outcome.MASTER_DOWN,
    RPC_TIMEOUT: Outcome.MASTER_DOWN,
    UNAVAILABLE_IN_CURRENT_STATUS: Outcome.MASTER_DOWN,
}

# Failures after which a transfer may still be writing into (or reading from) the
# registered memory it was given: that memory must not be reused right away.
_SAFE_FOR_MEMORY = frozenset(
    {
        NO_AVAILABLE_HANDLE,
        TENANT_QUOTA_EXCEEDED,
        TENANT_NOT_REGISTERED,
        INVALID_PARAMS,
        REPLICA_IS_NOT_READY,
        OBJECT_NOT_FOUND,
        OBJECT_ALREADY_EXISTS,
        RPC_FAIL,
        RPC_TIMEOUT,
    }
)


def outcome(code: int) -> Outcome:
    """The meaning of a return code (``>= 0`` is success: 0 or a byte count)."""
    if code >= 0:
        return Outcome.OK
    return _BY_CODE.get(code, Outcome.OTHER)


def memory_reusable(code: int) -> bool:
    """Whether the buffers a call was given may be reused once it returned ``code``."""
    return code >= 0 or code in _SAFE_FOR_MEMORY
