"""Sending and receiving the buckets of a version over a weight-update group.

Two wire layouts, named by ``UpdateWeightsFromDistributedRequest.load_format``:

* ``""`` (``LOAD_FORMAT_PER_TENSOR``, SGLang's): one broadcast per tensor, in the order
  of ``names``, with the listed dtype and shape — what a real SGLang engine receives.
* ``"tauflow_flat_v1"`` (``LOAD_FORMAT_FLAT``, the sidecar's default): the bucket's bytes,
  laid out by the manifest's rule (``canonical_layout``), as ONE uint8 broadcast; the
  receiver cuts the tensors out of that buffer. One collective per bucket instead of one
  per tensor: fewer round trips for the many small tensors of a model (norms, biases).

The receiver hashes what it received, in manifest byte order (padding as zeros), and
compares it with the manifest's checksum after the last bucket before it hands the
version to its callback.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tauflow.weightsync.checksum import DEFAULT_ALGORITHM, Hasher, new_hasher, update_zeros
from tauflow.weightsync.errors import ChecksumMismatch, ManifestError, WeightSyncError
from tauflow.weightsync.group import GroupSpec, WeightGroup, connect_store
from tauflow.weightsync.manifest import (
    BucketSpec,
    Manifest,
    canonical_layout,
    check_shape,
    dtype_from_name,
    nbytes_of,
)
from tauflow.weightsync.staging import tensor_bytes

log = logging.getLogger(__name__)

LOAD_FORMAT_PER_TENSOR = ""
LOAD_FORMAT_FLAT = "tauflow_flat_v1"
LOAD_FORMATS = (LOAD_FORMAT_PER_TENSOR, LOAD_FORMAT_FLAT)


# -- sender (rank 0) -------------------------------------------------------------------


def bucket_tensors(bucket: BucketSpec, data: torch.Tensor) -> list[torch.Tensor]:
    """Views of each tensor of ``bucket`` in ``data`` (the bucket's bytes, uint8)."""
    out = []
    for t in bucket.tensors:
        view = data[t.offset_bytes : t.offset_bytes + t.size_bytes].view(dtype_from_name(t.dtype))
        out.append(view.reshape(t.shape))
    return out


def send_bucket(
    group: WeightGroup,
    bucket: BucketSpec,
    data: torch.Tensor,
    *,
    policy_version: int,
    load_format: str = LOAD_FORMAT_FLAT,
) -> None:
    """Rank 0: broadcasts one bucket (``data``: its bytes, uint8) in ``load_format``."""
    if data.device != group.device:
        data = data.to(group.device, non_blocking=True)
    if load_format == LOAD_FORMAT_FLAT:
        tensors = [data[: bucket.size_bytes]]
    elif load_format == LOAD_FORMAT_PER_TENSOR:
        tensors = bucket_tensors(bucket, data)
    else:
        raise ValueError(f"unknown load_format {load_format!r}; supported: {LOAD_FORMATS}")
    group.broadcast(tensors, policy_version=policy_version, bucket_index=bucket.index)


def bucket_requests(
    manifest: Manifest,
    *,
    group_name: str,
    membership_epoch: int,
    load_format: str = LOAD_FORMAT_FLAT,
    flush_cache: bool = True,
) -> list[BucketRequest]:
    """The receive request of every bucket of ``manifest`` (what UpdateWeightsFromDistributed carries)."""
    n = len(manifest.buckets)
    return [
        BucketRequest(
            names=[t.name for t in b.tensors],
            dtypes=[t.dtype for t in b.tensors],
            shapes=[list(t.shape) for t in b.tensors],
            group_name=group_name,
            policy_version=manifest.policy_version,
            membership_epoch=membership_epoch,
            bucket_index=b.index,
            bucket_count=n,
            load_format=load_format,
            manifest_checksum=manifest.checksum,
            checksum_algorithm=manifest.checksum_algorithm,
            flush_cache=flush_cache and b.index == n - 1,
        )
        for b in manifest.buckets
    ]


# -- receiver --------------------------------------------------------------------------


class ReceiveError(WeightSyncError):
    """A receive request that cannot be served; ``kind`` says how (for a status code)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind  # invalid | precondition | exists


@dataclass(frozen=True)
class BucketRequest:
    """One bucket to receive (UpdateWeightsFromDistributedRequest, as plain data)."""

    names: Sequence[str]
    dtypes: Sequence[str]
    shapes: Sequence[Sequence[int]]
    group_name: str
    policy_version: int
    membership_epoch: int
    bucket_index: int
    bucket_count: int
    load_format: str = LOAD_FORMAT_PER_TENSOR
    manifest_checksum: str = ""
    checksum_algorithm: str = DEFAULT_ALGORITHM
    flush_cache: bool = False
    traceparent: str = ""  # W3C context of the trainer's `weights.publish` of the version
    tracestate: str = ""


@dataclass
class ReceivedVersion:
    """A complete, verified version, as handed to the engine."""

    policy_version: int
    membership_epoch: int
    tensors: dict[str, torch.Tensor]
    manifest_checksum: str
    loaded_checksum: str
    checksum_algorithm: str
    load_duration_s: float
    nbytes: int
    flush_cache: bool = False


@dataclass
class _Partial:
    policy_version: int
    checksum_algorithm: str
    hasher: Hasher
    started: float
    next_bucket: int = 0
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    nbytes: int = 0


class WeightReceiver:
    """The receiving side of one engine rank: holds its weight-update group, receives
    buckets, verifies the version and hands it to ``on_version``.

    Calls are blocking (run them in a worker thread from asyncio) and serialized.
    ``rank_offset`` in ``init_group`` is this rank's rank; an engine with k devices runs
    one receiver per device with ranks ``rank_offset + i``.
    """

    def __init__(
        self,
        on_version: Callable[[ReceivedVersion], None] | None = None,
        *,
        label: str = "receiver",
        verify_checksum: bool = True,
        device: str | None = None,
        reuse_buffers: bool = True,
    ) -> None:
        self.on_version = on_version
        self.label = label
        self.verify_checksum = verify_checksum
        self._device = device
        self.reuse_buffers = reuse_buffers
        # Receive buffers, one per bucket, in two sets used by alternate versions: the tensors
        # handed out for version N stay valid while N+1 arrives and are overwritten by N+2
        # (the sidecar sends N+1 only after N was confirmed, i.e. swapped in). The set changes when a
        # version is complete: a version received again after a failure reuses the set it failed in.
        self._buffers: list[dict[int, torch.Tensor]] = [{}, {}]
        self._parity = 0  # the set the next version is received into
        self._lock = threading.Lock()  # the group and the version being received
        self._build_lock = threading.Lock()  # one group build at a time (never held with ``_lock`` waited for)
        self._generation = 0  # counts resets: a build that a reset overtook is not installed
        self._group: WeightGroup | None = None
        self._partial: _Partial | None = None
        self._stores: dict[tuple[str, int], dist.Store] = {}

    # -- group --

    @property
    def group(self) -> WeightGroup | None:
        return self._group

    @property
    def receiving_version(self) -> int | None:
        return self._partial.policy_version if self._partial else None

    def init_group(self, spec: GroupSpec) -> int:
        """Joins the group (SGLang's init_weights_update_group); returns this rank's count (1).

        Idempotent by ``group_name`` with the same arguments. ``ReceiveError('exists')``
        for the same name with other arguments, ``('precondition')`` when a group of a
        newer epoch is held, ``('invalid')`` for bad arguments; ``PhaseError(GROUP_INIT)``
        when the rendezvous misses its deadline (``spec.timeout_s``, once: a store nobody
        serves included). The group held before is left only once the new one has formed:
        a refused call keeps it.

        The new group forms without the lock a receive holds (a build may take its whole timeout: receives and
        ``destroy_group`` go on meanwhile); it is swapped in under it. The group it replaces is aborted first,
        so that a receive still waiting in it (its sender moved on to the new group) ends at once. One build
        at a time.
        """
        if not spec.group_name or not spec.master_address:
            raise ReceiveError("invalid", "group_name and master_address must be set")
        if not 1 <= spec.master_port <= 65535:
            raise ReceiveError("invalid", f"master_port {spec.master_port} is out of range 1..65535")
        if not 1 <= spec.rank < spec.world_size:
            raise ReceiveError(
                "invalid", f"rank {spec.rank} must be in 1..{spec.world_size - 1} (rank 0 is the sender)"
            )
        if self._held(spec):
            return 1
        with self._build_lock:
            if self._held(spec):  # (built by the call this one waited for)
                return 1
            generation = self._generation
            # The new group forms first: a request whose group never forms (a store nobody serves, a sender
            # that never joins) is refused and leaves the group held, and a version it was receiving, as they were.
            key = (spec.master_address, spec.master_port)
            store = self._stores.get(key)
            if store is None:
                store = connect_store(spec.master_address, spec.master_port, spec.timeout_s, label=self.label)
            new = WeightGroup(store, spec, {0: "sender"})
            old = self._group
            if (
                old is not None
                and self._generation == generation
                and old.spec.membership_epoch <= spec.membership_epoch
            ):
                old.abort(f"group {spec.group_name!r} of epoch {spec.membership_epoch} replaces it")
            with self._lock:
                try:
                    if self._generation != generation:
                        raise ReceiveError("precondition", "the receiver was reset while the group formed")
                    self._held(spec)
                except BaseException:
                    new.destroy()
                    raise
                self._stores[key] = store
                g = self._group
                if g is not None:
                    g.destroy()
                self._group = new
                self._partial = None
            log.info(
                "joined weight group",
                extra={"group": spec.group_name, "rank": spec.rank, "world_size": spec.world_size},
            )
            return 1

    def _held(self, spec: GroupSpec) -> bool:
        """Whether the group ``spec`` names is held already; refuses a spec that conflicts with the group held."""
        g = self._group
        if g is None or g.destroyed:
            return False
        if g.name == spec.group_name:
            if g.spec != spec:
                raise ReceiveError("exists", f"group {spec.group_name!r} exists with other arguments")
            return True
        if g.spec.membership_epoch > spec.membership_epoch:
            raise ReceiveError(
                "precondition",
                f"already in group {g.name!r} of epoch {g.spec.membership_epoch}, newer than {spec.membership_epoch}",
            )
        return False

    def destroy_group(self, group_name: str) -> bool:
        """Leaves ``group_name`` (SGLang's destroy_weights_update_group); False when not held.
        A partially received version is discarded (a receive waiting in the group ends at once); the last
        complete one is kept."""
        if not group_name:
            raise ReceiveError("invalid", "group_name must be set")
        g = self._group
        if g is not None and g.name == group_name:
            g.abort(f"group {group_name!r} was destroyed")  # (ends a receive that holds the lock)
        with self._lock:
            g = self._group
            if g is None or g.name != group_name:
                return False
            g.destroy()
            self._group = None
            self._partial = None
            return True

    def reset(self) -> None:
        """Forgets the group, a partially received version and the store connections, before this rank
        joins a sidecar again: the one that built them restarted (its next group may have a lower epoch,
        on a new store) or dropped this rank. The last complete version is kept. A receive waiting in the
        group ends at once; a group build under way is not installed."""
        self._generation += 1
        g = self._group
        if g is not None:
            g.abort("the receiver was reset")
        with self._lock:
            if self._group is not None:
                self._group.destroy()
            self._group = None
            self._partial = None
            self._stores.clear()

    # -- buckets --

    def check_bucket(self, req: BucketRequest) -> None:
        """Raises the ReceiveError that ``receive_bucket`` would raise for ``req`` as things stand, at once:
        it does not wait for a receive in progress (``receive_bucket`` checks again under the lock). Lets a
        caller refuse a bad request before it does anything for it."""
        self._check(req)

    def _check(self, req: BucketRequest) -> WeightGroup:
        n = len(req.names)
        if n == 0 or len(req.dtypes) != n or len(req.shapes) != n:
            raise ReceiveError(
                "invalid",
                f"names, dtypes and shapes must be non-empty and of one length, not "
                f"{n}, {len(req.dtypes)}, {len(req.shapes)}",
            )
        if req.bucket_index >= req.bucket_count:
            raise ReceiveError(
                "invalid", f"bucket_index {req.bucket_index} is not below bucket_count {req.bucket_count}"
            )
        if req.load_format not in LOAD_FORMATS:
            raise ReceiveError("invalid", f"unknown load_format {req.load_format!r}; supported: {LOAD_FORMATS}")
        try:
            for d in req.dtypes:
                dtype_from_name(d)
            for i, shape in enumerate(req.shapes):
                check_shape(shape, f"shapes[{i}]")  # (before the bucket's layout is computed from them)
        except ManifestError as e:
            raise ReceiveError("invalid", str(e)) from None
        g = self._group
        if g is None or g.name != req.group_name:
            raise ReceiveError("precondition", f"no weight group {req.group_name!r} (InitWeightsUpdateGroup first)")
        if g.spec.membership_epoch != req.membership_epoch:
            raise ReceiveError(
                "precondition",
                f"membership_epoch {req.membership_epoch} is not group {g.name!r}'s epoch {g.spec.membership_epoch}",
            )
        p = self._partial
        if req.bucket_index != 0 and (
            p is None or p.policy_version != req.policy_version or p.next_bucket != req.bucket_index
        ):
            expected = "bucket 0" if p is None or p.policy_version != req.policy_version else f"bucket {p.next_bucket}"
            raise ReceiveError(
                "precondition",
                f"bucket {req.bucket_index} of version {req.policy_version} arrived out of order (expected {expected})",
            )
        return g

    def receive_bucket(self, req: BucketRequest) -> ReceivedVersion | None:
        """Posts the receives of one bucket and waits for them; after the last bucket,
        verifies the version and hands it to ``on_version`` and returns it.

        ``PhaseError(TRANSFER)`` when the broadcast fails or misses the group's deadline
        (the partial version is discarded); ``ChecksumMismatch`` when the complete
        version does not match ``manifest_checksum``.
        """
        with self._lock:
            group = self._check(req)
            if req.bucket_index == 0:
                self._partial = _Partial(
                    req.policy_version, req.checksum_algorithm, new_hasher(req.checksum_algorithm), time.monotonic()
                )
            p = self._partial
            assert p is not None
            try:
                self._receive(group, req, p)
            except BaseException:
                self._partial = None
                # A receive that failed may still be posted (an aborted gloo collective ends at its timeout):
                # its buffer is not reused, so that nothing the old group delivers late lands in a new version.
                self._buffers[self._parity].pop(req.bucket_index, None)
                raise
            p.next_bucket += 1
            if req.bucket_index + 1 < req.bucket_count:
                return None
            self._partial = None
            loaded = p.hasher.hexdigest()
            if self.verify_checksum and req.manifest_checksum and loaded != req.manifest_checksum:
                raise ChecksumMismatch(
                    f"version {req.policy_version} received by {self.label}",
                    req.checksum_algorithm,
                    req.manifest_checksum,
                    loaded,
                )
            self._parity ^= 1  # the next version goes into the other set (a refused one's set is reused)
            version = ReceivedVersion(
                policy_version=req.policy_version,
                membership_epoch=req.membership_epoch,
                tensors=p.tensors,
                manifest_checksum=req.manifest_checksum,
                loaded_checksum=loaded,
                checksum_algorithm=req.checksum_algorithm,
                load_duration_s=time.monotonic() - p.started,
                nbytes=p.nbytes,
                flush_cache=req.flush_cache,
            )
        if self.on_version is not None:
            self.on_version(version)
        return version

    def _receive(self, group: WeightGroup, req: BucketRequest, p: _Partial) -> None:
        device = torch.device(self._device) if self._device else group.device
        layout, bucket_size = canonical_layout(req.dtypes, req.shapes)
        buf = self._bucket_buffer(req.bucket_index, bucket_size, device)
        tensors = [
            buf[offset : offset + size].view(dtype_from_name(dtype)).reshape(tuple(shape))
            for dtype, shape, (offset, size) in zip(req.dtypes, req.shapes, layout, strict=True)
        ]
        group.mark_posted(req.policy_version, req.bucket_index)
        if req.load_format == LOAD_FORMAT_FLAT:
            group.broadcast([buf], policy_version=req.policy_version, bucket_index=req.bucket_index)
            cpu = buf if buf.device.type == "cpu" else buf.cpu()
            p.hasher.update(cpu.numpy().data)
            p.tensors.update(zip(req.names, tensors, strict=True))
        else:
            # SGLang's layout: one broadcast per tensor, received into views of the same bucket buffer
            group.broadcast(tensors, policy_version=req.policy_version, bucket_index=req.bucket_index)
            end = 0
            for name, t, (offset, size) in zip(req.names, tensors, layout, strict=True):
                update_zeros(p.hasher, offset - end)
                p.hasher.update(tensor_bytes(t).data)
                end = offset + size
                p.tensors[name] = t
            update_zeros(p.hasher, bucket_size - end)
        p.nbytes += sum(nbytes_of(d, s) for d, s in zip(req.dtypes, req.shapes, strict=True))

    def _bucket_buffer(self, index: int, nbytes: int, device: torch.device) -> torch.Tensor:
        if not self.reuse_buffers:
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        pool = self._buffers[self._parity]
        buf = pool.get(index)
        if buf is None or buf.numel() != nbytes or buf.device != device:
            buf = pool[index] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf
