"""What the sidecar's domain needs from the rollout servers; app.py wires the gRPC adapter
(``adapters/rollout_client.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from tauflow.weightsync import BucketRequest, GroupSpec, SharedRequest


class MemberCallFailed(Exception):
    """A member RPC that failed; ``code`` is the status name (e.g. ``UNAVAILABLE``).

    ``collateral`` is true when the member answered that the collective itself failed
    (ABORTED, or its own DEADLINE_EXCEEDED before the call's deadline): it waited for
    another rank, so it is a victim of that rank's failure, not the cause.
    """

    def __init__(self, method: str, address: str, code: str, detail: str, collateral: bool = False) -> None:
        super().__init__(f"{method} at {address}: {code}: {detail}")
        self.code = code
        self.timed_out = code == "DEADLINE_EXCEEDED"
        self.collateral = collateral


class MemberClient(Protocol):
    """The weight-receiving RPCs of one rollout server; failures raise ``MemberCallFailed``."""

    async def init_group(self, spec: GroupSpec, timeout_s: float) -> None: ...

    async def update_bucket(self, request: BucketRequest, timeout_s: float) -> None: ...

    async def destroy_group(self, group_name: str, timeout_s: float) -> None: ...

    async def update_from_shared(self, request: SharedRequest, timeout_s: float) -> None: ...

    async def probe(self, timeout_s: float) -> None:
        """A cheap call (the server's status): ``MemberCallFailed`` with code ``UNAVAILABLE`` when nothing
        answers at the address (a dead process)."""
        ...

    async def close(self) -> None: ...


MemberClientFactory = Callable[[str], MemberClient]
"""Opens the client of the rollout server at an address."""
