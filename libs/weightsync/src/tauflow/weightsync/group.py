"""Process groups per membership epoch, built straight on a TCPStore, outside the default group.

The sidecar hosts one ``TCPStore`` (``StoreHost``) and is rank 0 of every group; a
rollout server's ranks connect to it (``connect_store``). Each group rendezvouses under
its own prefix, ``<group_name>/<device>/`` (the prefix torch's ``new_group`` /
SGLang's ``init_custom_process_group`` use, device ``cpu`` for gloo, ``cuda`` for
nccl), so groups of several epochs, or to several engines, coexist in one process and
on one store. The group's timeout is the phase deadline: the rendezvous and every
collective fail after it instead of hanging.

Besides the backend's own keys, every rank writes two small keys under
``<group_name>/tauflow/`` — ``joined/<rank>`` before the rendezvous and
``posted/<rank>`` (``"<version>:<bucket>"``) before it posts the receives of a bucket —
so that a missed deadline names the ranks that did not arrive.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tauflow.weightsync.errors import Phase, PhaseError, looks_like_timeout

log = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class GroupSpec:
    """What a rank needs to join a weight-update group (InitWeightsUpdateGroupRequest)."""

    master_address: str
    master_port: int
    group_name: str
    world_size: int
    rank: int
    backend: str = "gloo"
    membership_epoch: int = 0
    timeout_s: float = 60.0


def device_type(backend: str) -> str:
    if backend == "gloo":
        return "cpu"
    if backend == "nccl":
        return "cuda"
    raise ValueError(f"unknown backend {backend!r}; supported: {', '.join(BACKENDS)}")


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


class StoreHost:
    """The sidecar's TCPStore server: the rendezvous point of every group it builds."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 60.0) -> None:
        self.store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=_td(timeout_s))
        self.host = host
        self.port = int(self.store.port)


def connect_store(address: str, port: int, timeout_s: float, *, label: str = "") -> dist.Store:
    """A client of the TCPStore at ``address:port``; a failure is a GROUP_INIT error naming it."""
    try:
        return dist.TCPStore(address, port, is_master=False, timeout=_td(timeout_s))
    except Exception as e:  # torch raises several types here
        raise PhaseError(
            Phase.GROUP_INIT,
            f"store {address}:{port}",
            f"{label + ': ' if label else ''}cannot connect: {e}",
            deadline_s=timeout_s,
            timed_out=looks_like_timeout(e),
        ) from e


def describe_ranks(ranks: Sequence[int], labels: Mapping[int, str]) -> str:
    """``rank 2 (member-b)``, ``ranks 1, 3 (member-a, member-c)``."""
    if not ranks:
        return "the group"
    names = sorted({labels[r] for r in ranks if r in labels})
    head = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(str(r) for r in ranks)
    return f"{head} ({', '.join(names)})" if names else head


class WeightGroup:
    """One rank of a weight-update group: rank 0 (the sender) or a receiving rank.

    ``labels`` maps ranks to peer names (member ids) for error messages.
    """

    def __init__(self, store: dist.Store, spec: GroupSpec, labels: Mapping[int, str] | None = None) -> None:
        if not 0 <= spec.rank < spec.world_size:
            raise ValueError(f"rank {spec.rank} is not in a group of {spec.world_size}")
        self.spec = spec
        self.labels = dict(labels or {})
        self.labels.setdefault(0, "sender")
        self.device = torch.device(device_type(spec.backend))
        self._store = store
        self._meta = dist.PrefixStore(f"{spec.group_name}/tauflow/", store)
        self._pg = None
        started = time.monotonic()
        try:
            self._meta.set(f"joined/{spec.rank}", str(spec.membership_epoch))
            backend_store = dist.PrefixStore(f"{spec.group_name}/{self.device.type}/", store)
            self._pg = _make_backend(spec, backend_store)
        except Exception as e:
            peer, ranks = self._peers_missing("joined", None)
            raise PhaseError(
                Phase.GROUP_INIT,
                peer,
                f"group {spec.group_name!r} ({spec.world_size} ranks, {spec.backend}) did not form: {e}",
                deadline_s=spec.timeout_s,
                timed_out=looks_like_timeout(e),
                membership_epoch=spec.membership_epoch,
                ranks=ranks,
            ) from e
        log.debug(
            "group formed",
            extra={"group": spec.group_name, "rank": spec.rank, "seconds": round(time.monotonic() - started, 3)},
        )

    @property
    def name(self) -> str:
        return self.spec.group_name

    @property
    def rank(self) -> int:
        return self.spec.rank

    def _others(self) -> list[int]:
        return [r for r in range(self.spec.world_size) if r != self.spec.rank]

    def _peers_missing(self, key: str, value: str | None) -> tuple[str, tuple[int, ...]]:
        """Names the ranks whose ``key`` is absent (or not ``value``): the ones that did not arrive."""
        if self.spec.rank != 0:
            return describe_ranks([0], self.labels), (0,)
        missing = []
        for r in self._others():
            try:
                if not self._meta.check([f"{key}/{r}"]) or (
                    value is not None and self._meta.get(f"{key}/{r}").decode() != value
                ):
                    missing.append(r)
            except Exception:  # noqa: BLE001 - the store itself may be gone; name everyone
                missing.append(r)
        if missing:
            return describe_ranks(missing, self.labels), tuple(missing)
        # every rank arrived: the failure is not one rank's absence (e.g. a peer died mid-collective)
        return f"{describe_ranks(self._others(), self.labels)} (every rank arrived)", ()

    def mark_posted(self, policy_version: int, bucket_index: int) -> None:
        """Receiving ranks: record that this rank posts the receives of a bucket now."""
        self._meta.set(f"posted/{self.spec.rank}", f"{policy_version}:{bucket_index}")

    def broadcast(self, tensors: Sequence[torch.Tensor], *, policy_version: int, bucket_index: int) -> None:
        """Broadcasts ``tensors`` from rank 0, one collective each, in order; receivers pass
        their receive buffers. Returns when all are done; a failure or a missed deadline
        raises ``PhaseError(TRANSFER)`` naming the peer."""
        if self._pg is None:
            raise PhaseError(Phase.TRANSFER, "the group", f"group {self.name!r} was destroyed")
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        try:
            works = [self._pg.broadcast([t], opts) for t in tensors]
            for w in works:
                w.wait()
        except Exception as e:
            peer, ranks = self._peers_missing("posted", f"{policy_version}:{bucket_index}")
            raise PhaseError(
                Phase.TRANSFER,
                peer,
                f"broadcast in group {self.name!r} failed: {e}",
                deadline_s=self.spec.timeout_s,
                timed_out=looks_like_timeout(e),
                policy_version=policy_version,
                membership_epoch=self.spec.membership_epoch,
                bucket_index=bucket_index,
                ranks=ranks,
            ) from e

    def destroy(self) -> None:
        """Leaves the group and frees its connections (idempotent)."""
        pg, self._pg = self._pg, None
        if pg is None:
            return
        try:
            pg.shutdown()
        except Exception:  # best effort; dropping the reference closes it too
            log.debug("shutdown of group %s failed", self.name, exc_info=True)

    @property
    def destroyed(self) -> bool:
        return self._pg is None


def _make_backend(spec: GroupSpec, store: dist.Store) -> Any:  # torch's stubs: no common type with collectives
    timeout = _td(spec.timeout_s)
    if spec.backend == "gloo":
        return dist.ProcessGroupGloo(store, spec.rank, spec.world_size, timeout)
    if spec.backend == "nccl":
        # Same code path on GPUs; imported lazily so CPU builds of torch never touch it.
        from torch.distributed import ProcessGroupNCCL

        opts = ProcessGroupNCCL.Options()
        opts._timeout = timeout
        opts.is_high_priority_stream = False
        pg = ProcessGroupNCCL(store, spec.rank, spec.world_size, opts)
        # NCCL connects lazily; a tiny collective makes the rendezvous happen now, within the deadline.
        probe = torch.zeros(1, device="cuda")
        o = dist.BroadcastOptions()
        o.rootRank = 0
        o.rootTensor = 0
        pg.broadcast([probe], o).wait()  # type: ignore[attr-defined]  # torch's stubs omit the backend's collectives
        torch.cuda.synchronize()
        return pg
    raise ValueError(f"unknown backend {spec.backend!r}; supported: {', '.join(BACKENDS)}")
