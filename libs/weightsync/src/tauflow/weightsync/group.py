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

A group can be aborted from another thread (``WeightGroup.abort``): a broadcast waiting in it raises at
once, and so does every later one. Its members use that when a peer is known to be gone, instead of
waiting for the group's timeout: the sender when a member's own call failed, a receiver when the sender
destroys the group or a newer group forms. NCCL aborts the collective itself; gloo cannot interrupt one
(it ends at the group's timeout, whatever else happens — a peer's death, the process group's
``abort``/``shutdown``, even the sender's exit), so the wait stops and the group, never used again, is kept
aside until its collective ends (dropping it earlier would block the thread that drops it until then).
"""

from __future__ import annotations

import atexit
import ctypes
import datetime
import logging
import os
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tauflow.weightsync.errors import Phase, PhaseError, looks_like_timeout

log = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")
# A group's build gets its timeout and this much more before it is left behind: gloo's rendezvous, given a
# peer address planted in the store by an outsider, was seen to hang in its connect for minutes past the
# timeout it was given, holding the rollout's one build slot (every later build refused) long after.
BUILD_GRACE_S = 5.0  # (gloo ends a build by its timeout itself; the sidecar's call to a member waits 2 s more)

# Process groups destroyed while a collective of theirs still ran (gloo's ends only at the group's timeout), with
# those collectives: kept until they end, then dropped (``_reap_abandoned``).
_abandoned: list[tuple[Any, list[Any]]] = []
_abandoned_lock = threading.Lock()


@atexit.register
def _leave_abandoned_at_exit() -> None:
    """At exit the abandoned process groups are left to the OS, never destroyed: their destructor would block the
    exit until their collective's timeout, then abort the process."""
    with _abandoned_lock:
        for entry in _abandoned:
            for obj in (entry[0], *entry[1]):
                ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


def _reap_abandoned() -> None:
    """Drops the abandoned process groups whose collectives have ended (their destructor then returns at once)."""
    with _abandoned_lock:
        ended = [entry for entry in _abandoned if all(w.get_future().done() for w in entry[1])]
        _abandoned[:] = [entry for entry in _abandoned if not any(entry is e for e in ended)]
    del ended  # (outside the lock)


def abandoned_groups() -> int:
    """How many destroyed process groups still wait for a collective of theirs to end."""
    _reap_abandoned()
    with _abandoned_lock:
        return len(_abandoned)


class _Aborted(Exception):
    pass


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
        # Listens on ``host`` only: torch's master store binds every interface whatever its host says (a store
        # meant for loopback was open to the network), so the socket is bound here and handed to it.
        listener = _listening_socket(host, port)
        bound_port = listener.getsockname()[1]
        # The store owns the descriptor from here on and closes it when it goes: detached, so that Python does not
        # close it too (a second close took whatever descriptor had the number by then: a test process aborted).
        listen_fd = listener.detach()
        # (on a failure the descriptor may be torch's already: left open rather than closed twice)
        self.store = dist.TCPStore(
            host,
            bound_port,
            is_master=True,
            wait_for_workers=False,
            timeout=_td(timeout_s),
            master_listen_fd=listen_fd,
        )
        self.host = host
        self.port = int(self.store.port)

    def clear(self) -> int:
        """Deletes every key (call it between two groups: a rank still in a build left behind loses the keys of a
        group nobody joins any more); returns how many.
        Each group leaves a few keys a rank, and the store takes no token: what an outsider wrote stays held
        in this process's memory until then (1.2 GB in 6 s from one client), and a run's hundred epochs kept
        five hundred keys."""
        keys = self.store.list_keys()
        for key in keys:
            self.store.delete_key(key)
        return len(keys)


def _listening_socket(host: str, port: int) -> socket.socket:
    # (an empty host is every interface, as torch's own bind was; "[::1]" is an IPv6 address)
    name = host.strip("[]") or None
    family, kind, proto, _, address = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[
        0
    ]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(1024)
    except OSError:
        listener.close()
        raise
    return listener


_connecting: dict[tuple[str, int], Future[dist.Store]] = {}  # connections under way, by address
_connecting_lock = threading.Lock()


def _connect(key: tuple[str, int], timeout_s: float, result: Future[dist.Store]) -> None:
    try:
        result.set_result(dist.TCPStore(key[0], key[1], is_master=False, timeout=_td(timeout_s)))
    except BaseException as e:  # noqa: BLE001 - handed to the caller
        result.set_exception(e)
    finally:
        with _connecting_lock:
            if _connecting.get(key) is result:
                del _connecting[key]


def connect_store(address: str, port: int, timeout_s: float, *, label: str = "") -> dist.Store:
    """A client of the TCPStore at ``address:port``; a failure is a GROUP_INIT error naming it.

    Returns or fails within ``timeout_s``: torch's own connect tries again after its timeout (a port nobody
    serves took up to twice the timeout) and waits without a bound for a listener that never answers, so it
    runs on a thread of its own, left to end by itself when the caller's time is up. A call for an address
    whose connection is under way waits for that one (one such thread per address at most)."""
    key = (address, port)
    with _connecting_lock:
        pending = _connecting.get(key)
        if pending is None:
            pending = _connecting[key] = Future()
            threading.Thread(
                target=_connect, args=(key, timeout_s, pending), name=f"store-connect-{address}:{port}", daemon=True
            ).start()
    try:
        return pending.result(timeout=timeout_s)
    except Exception as e:  # torch raises several types here
        timed_out = isinstance(e, FutureTimeout)
        raise PhaseError(
            Phase.GROUP_INIT,
            f"store {address}:{port}",
            f"{label + ': ' if label else ''}cannot connect: "
            + (f"no answer within {timeout_s:g}s" if timed_out else str(e)),
            deadline_s=timeout_s,
            timed_out=timed_out or looks_like_timeout(e),
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
        self._pg: Any = None
        self._cond = threading.Condition()  # a collective ended, or the group was aborted
        self._aborted: str | None = None  # why, once aborted or destroyed
        self._pending: list[Any] = []  # the collectives a broadcast waits for
        _reap_abandoned()
        started = time.monotonic()
        try:
            self._meta.set(f"joined/{spec.rank}", str(spec.membership_epoch))
            backend_store = dist.PrefixStore(f"{spec.group_name}/{self.device.type}/", store)
            self._pg = _build_bounded(spec, backend_store)
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
        raises ``PhaseError(TRANSFER)`` naming the peer, and so does an ``abort`` (at once)."""
        epoch = self.spec.membership_epoch
        if self._pg is None or self._aborted is not None:
            raise PhaseError(
                Phase.TRANSFER,
                "the group",
                f"group {self.name!r} was destroyed"
                if self._pg is None
                else f"group {self.name!r} was aborted: {self._aborted}",
                bucket_index=bucket_index,
                policy_version=policy_version,
                membership_epoch=epoch,
            )
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        try:
            works = [self._pg.broadcast([t], opts) for t in tensors]
            self._wait(works)
        except _Aborted as e:
            raise PhaseError(
                Phase.TRANSFER,
                "the group",
                f"broadcast in group {self.name!r} was aborted: {e}",
                bucket_index=bucket_index,
                policy_version=policy_version,
                membership_epoch=epoch,
            ) from None
        except Exception as e:
            peer, ranks = self._peers_missing("posted", f"{policy_version}:{bucket_index}")
            raise PhaseError(
                Phase.TRANSFER,
                peer,
                f"broadcast in group {self.name!r} failed: {e}",
                deadline_s=self.spec.timeout_s,
                timed_out=looks_like_timeout(e),
                bucket_index=bucket_index,
                ranks=ranks,
                policy_version=policy_version,
                membership_epoch=epoch,
            ) from e

    def _wait(self, works: list[Any]) -> None:
        """Waits for ``works``; raises _Aborted as soon as the group is aborted."""
        if self.device.type != "cpu":
            # NCCL: wait() makes the current stream wait (the CPU does not block); abort() ends a hung collective.
            for w in works:
                w.wait()
            return
        with self._cond:
            if self._aborted is not None:
                raise _Aborted(self._aborted)
            self._pending = works
        # (a work's future is done before the work says it is completed: the futures are what the wait watches)
        futures = [w.get_future() for w in works]
        for f in futures:  # (a callback of a future already done runs here: the condition is not held)
            f.add_done_callback(self._notify)
        with self._cond:
            # (the timeout only re-checks, should a callback never come: gloo's own deadline ends every work)
            while self._aborted is None and not all(f.done() for f in futures):
                self._cond.wait(1.0)
            if not all(f.done() for f in futures):
                raise _Aborted(self._aborted)
            self._pending = []
        for w in works:
            w.wait()  # done: returns, or raises the collective's error, at once

    def _notify(self, _: Any) -> None:
        with self._cond:
            self._cond.notify_all()

    def abort(self, reason: str) -> None:
        """Makes a broadcast waiting in this group (on another thread) raise ``PhaseError(TRANSFER)`` at once,
        and every later one; the group is not usable any more (``destroy`` it). NCCL's collectives are aborted;
        gloo's end at the group's timeout in the backend's thread (``destroy`` keeps the group until then)."""
        with self._cond:
            if self._aborted is None:
                self._aborted = reason
            self._cond.notify_all()
        if self._pg is not None:
            self._abort_backend(self._pg)

    def _abort_backend(self, pg: Any) -> None:
        if self.spec.backend != "nccl":
            return  # (gloo's abort() interrupts nothing)
        try:
            pg.abort()
        except Exception:  # best effort: the collective then ends at its timeout
            log.debug("abort of group %s failed", self.name, exc_info=True)

    @property
    def aborted(self) -> bool:
        return self._aborted is not None

    @property
    def collectives_pending(self) -> int:
        """The collectives a broadcast on the CPU waits for now (0: none posted, or all done)."""
        with self._cond:
            return len(self._pending)

    def destroy(self) -> None:
        """Leaves the group and frees its connections (idempotent); never blocks: a broadcast waiting in it
        raises (as after ``abort``), and a collective that still runs keeps the process group alive, aside,
        until it ends."""
        with self._cond:
            pg, self._pg = self._pg, None
            if self._aborted is None:
                self._aborted = "the group was destroyed"
            pending = [w for w in self._pending if not w.get_future().done()]
            self._pending = []
            self._cond.notify_all()
        if pg is None:
            return
        if pending:
            if self.spec.backend == "nccl":
                self._abort_backend(pg)
            log.info(
                "group destroyed while a collective still runs; it is kept until the collective ends",
                extra={"group": self.name, "collectives": len(pending)},
            )
            with _abandoned_lock:
                _abandoned.append((pg, pending))
        else:
            try:
                pg.shutdown()
            except Exception:  # best effort; dropping the reference closes it too
                log.debug("shutdown of group %s failed", self.name, exc_info=True)
            del pg
        _reap_abandoned()

    @property
    def destroyed(self) -> bool:
        return self._pg is None


def _build_bounded(spec: GroupSpec, store: dist.Store) -> Any:
    """``_make_backend`` on a thread of its own, waited for ``spec.timeout_s + BUILD_GRACE_S`` at most: past
    that it is left behind (a group it forms later is shut down) and TimeoutError is raised."""
    built: Future[Any] = Future()
    decided = threading.Lock()  # the build's end and the caller's giving up: one of them first
    left_behind = False

    def build() -> None:
        try:
            pg = _make_backend(spec, store)
        except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
            with decided:
                if not left_behind:
                    built.set_exception(e)
            return
        with decided:
            if not left_behind:
                built.set_result(pg)
                return
        try:
            pg.shutdown()
        except Exception:  # best effort: dropping it closes it too
            log.debug("shutdown of a group built too late failed", exc_info=True)

    threading.Thread(target=build, name=f"group-build-{spec.group_name}", daemon=True).start()
    try:
        return built.result(timeout=spec.timeout_s + BUILD_GRACE_S)
    except FutureTimeout:
        with decided:
            if not built.done():
                left_behind = True
        if left_behind:
            raise TimeoutError(
                f"the build did not return within its timeout of {spec.timeout_s:g}s and {BUILD_GRACE_S:g}s "
                "more; it was left behind"
            ) from None
        return built.result()  # (it ended as the wait did)


def _address_towards(spec: GroupSpec) -> str:
    """This machine's address on the route to the group's store (no packet is sent); "" (gloo's own choice)
    where there is none."""
    try:
        found = socket.getaddrinfo(spec.master_address.strip("[]"), spec.master_port, type=socket.SOCK_DGRAM)
        # IPv4 first where a name has both: every rank then picks the same family
        family, kind, proto, _, address = min(found, key=lambda a: a[0] != socket.AF_INET)
        with socket.socket(family, kind, proto) as probe:
            probe.connect(address)
            return str(probe.getsockname()[0])
    except OSError:
        return ""


def _make_backend(spec: GroupSpec, store: dist.Store) -> Any:  # torch's stubs: no common type with collectives
    timeout = _td(spec.timeout_s)
    if spec.backend == "gloo":
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # (torch stubs lack it)
        options._timeout = timeout
        # gloo listens where the machine's hostname resolves (a LAN address, for a run all on loopback) and takes
        # no token: it listens on the address that reaches the store instead, which its peers reach too.
        # (GLOO_SOCKET_IFNAME, where set, is the user's choice of interface: gloo's own default device reads it)
        if not os.environ.get("GLOO_SOCKET_IFNAME") and (hostname := _address_towards(spec)):
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=hostname)]
        else:
            options._devices = [dist.ProcessGroupGloo.create_default_device()]
        return dist.ProcessGroupGloo(store, spec.rank, spec.world_size, options)
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
