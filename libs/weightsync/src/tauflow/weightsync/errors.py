"""Errors of a weight transfer: every failure names its phase and its peer."""

from __future__ import annotations

import enum


class Phase(enum.Enum):
    """The phases of a version's way from the trainer to the rollout engines (weights.proto's BroadcastPhase)."""

    HANDOFF = "handoff"
    GROUP_INIT = "group_init"
    TRANSFER = "transfer"
    CONFIRM = "confirm"
    GROUP_DESTROY = "group_destroy"


class WeightSyncError(Exception):
    """Base of the library's errors."""


class ManifestError(WeightSyncError, ValueError):
    """A manifest that is empty or inconsistent; the message says which tensor or bucket and why."""


class ChecksumMismatch(WeightSyncError):
    """Bytes whose checksum differs from the manifest's.

    The message names only the manifest's checksum: the actual one is the digest of whatever the bytes were
    (for the sidecar, of a file a caller named), so it is kept in ``actual`` for a log line, never in an answer
    (a caller could learn a file's digest from it, then publish the file as a version)."""

    def __init__(self, what: str, algorithm: str, expected: str, actual: str) -> None:
        super().__init__(f"{what}: their {algorithm} checksum does not match the manifest's {expected}")
        self.algorithm = algorithm
        self.expected = expected
        self.actual = actual


class StagingError(WeightSyncError):
    """The staging area cannot be used (unknown scheme, wrong size)."""


class StagingNotFound(StagingError):
    """The staging area named by a URI does not exist."""


class PhaseError(WeightSyncError):
    """A phase that failed with a peer, or missed its deadline.

    ``str(err)`` names both, e.g. ``transfer with peer rank 2 (member-b) missed its
    deadline of 5.0s (version 7, epoch 3, bucket 4): ...``.
    """

    def __init__(
        self,
        phase: Phase,
        peer: str,
        detail: str,
        *,
        deadline_s: float | None = None,
        timed_out: bool = False,
        policy_version: int | None = None,
        membership_epoch: int | None = None,
        bucket_index: int | None = None,
        ranks: tuple[int, ...] = (),
    ) -> None:
        self.phase = phase
        self.ranks = ranks  # the peer's ranks in the group, when known
        self.peer = peer
        self.detail = detail
        self.deadline_s = deadline_s
        self.timed_out = timed_out
        self.policy_version = policy_version
        self.membership_epoch = membership_epoch
        self.bucket_index = bucket_index
        super().__init__(self._message())

    def _message(self) -> str:
        where = []
        if self.policy_version is not None:
            where.append(f"version {self.policy_version}")
        if self.membership_epoch is not None:
            where.append(f"epoch {self.membership_epoch}")
        if self.bucket_index is not None:
            where.append(f"bucket {self.bucket_index}")
        ctx = f" ({', '.join(where)})" if where else ""
        if self.timed_out and self.deadline_s is not None:
            head = f"{self.phase.value} with peer {self.peer} missed its deadline of {self.deadline_s:g}s"
        else:
            head = f"{self.phase.value} with peer {self.peer} failed"
        return f"{head}{ctx}: {self.detail}"


def looks_like_timeout(err: BaseException) -> bool:
    """Whether a torch.distributed / gloo / store error is a missed deadline."""
    text = str(err).lower()
    return isinstance(err, TimeoutError) or "timed out" in text or "timeout" in text
