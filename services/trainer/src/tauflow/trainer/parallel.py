"""Data parallelism: the trainer role as N processes (ranks) joined by ``torch.distributed``.

Rank 0 leads. It alone talks to the queue, the weight sidecar and the checkpoint store; it plans each
step (skips, advantages, the normaliser of the whole batch), splits the samples that train across the
ranks balanced by tokens (:func:`balance_by_tokens`) and sends each rank its share. Every rank runs
forward/backward on its share with the loss normalised over the global batch, the gradients are reduced,
and every rank takes the same optimizer step: N ranks make the update one rank makes on the same groups.
The other ranks follow rank 0's commands (:meth:`RankGroup.receive`) until it says stop; a rank that
dies breaks its peers' next collective, so the role fails as one and is restarted as one (its launcher
starts the N ranks together, with their rendezvous).

Two strategies (docs/scaling.md says why FSDP2 is the default):

- ``fsdp``: FSDP2 (``torch.distributed.fsdp.fully_shard``): parameters, gradients and optimizer state are
  sharded across the ranks, each decoder layer (the model's ``_no_split_modules``) its own unit; the
  full weights exist only gathered, for a publish or a checkpoint.
- ``ddp``: ``DistributedDataParallel``: every rank holds everything, gradients are all-reduced.

Both reduce gradients by averaging over the ranks; the loss is multiplied by N before its backward, so
the average is the sum of the ranks' gradients, i.e. the gradient of the global loss. FSDP2 runs
collectives in every forward and backward, so every rank runs the same number of micro-batches
(:meth:`RankGroup.most`): a rank with fewer pads with an empty one whose loss is 0.

Checkpoints are gathered (rank 0 writes the full weights in Hugging Face format and the optimizer state
keyed as a single process keys it), so a checkpoint resumes at any world size. Only rank 0 reads one:
every rank starts from rank 0's weights (:meth:`RankGroup.overwrite_with_leaders`) and rank 0 shares the
rest of the state (:meth:`RankGroup.share`), so the other ranks need no access to the checkpoints (on
Kubernetes they are on rank 0's volume alone). The control plane (the
commands and each rank's share) is pickled objects on a gloo group: on CPU the default group, with NCCL
a gloo group beside it.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

STRATEGIES = ("fsdp", "ddp")
CLOSE_TIMEOUT_S = 30.0  # how long a closing rank waits for the others to close too
BACKENDS = ("auto", "gloo", "nccl")


@dataclass(frozen=True)
class DistributedConfig:
    """This process's place in the trainer role (the launcher sets it for each rank)."""

    world_size: int = 1
    """Ranks of the role; 1: one process, no torch.distributed."""
    rank: int = 0
    """This process's rank; rank 0 leads (queue, sidecar, checkpoints, the TrainerService)."""
    master_address: str = "127.0.0.1:29500"
    """host:port of the rendezvous (a TCPStore that rank 0 serves): the same for every rank."""
    backend: str = "auto"
    """gloo, nccl, or auto: nccl when the trainer's device is CUDA, gloo otherwise."""
    strategy: str = "fsdp"
    """fsdp (FSDP2, sharded) or ddp (replicated); see the module's docstring."""
    local_rank: int = -1
    """The rank's device index on its node (cuda:<local_rank>); -1: LOCAL_RANK, else rank."""
    timeout_s: float = 1800.0
    """Deadline of every collective: a rank that waits longer fails (and the role restarts)."""
    keepalive_s: float = 60.0
    """While rank 0 waits for data, it tells the other ranks it lives this often (well within timeout_s)."""

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"need world_size >= 1 and 0 <= rank < world_size, got {self.rank}/{self.world_size}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, not {self.strategy!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, not {self.backend!r}")
        host, _, port = self.master_address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"master_address must be host:port, not {self.master_address!r}")
        if self.timeout_s <= 0 or not 0 < self.keepalive_s < self.timeout_s:
            raise ValueError("need timeout_s > 0 and 0 < keepalive_s < timeout_s")

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def device_index(self) -> int:
        if self.local_rank >= 0:
            return self.local_rank
        return int(os.environ.get("LOCAL_RANK", self.rank))


def balance_by_tokens(lengths: Sequence[int], ranks: int) -> list[list[int]]:
    """Indices of the samples each rank trains: longest first, each to the rank with the fewest tokens so
    far (ties: the lowest rank), so the ranks' token counts differ by at most one sample's length. The
    same input gives the same split on every rank."""
    shares: list[list[int]] = [[] for _ in range(ranks)]
    load = [0] * ranks
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        shares[rank].append(i)
        load[rank] += lengths[i]
    return shares


def rank_device(config: DistributedConfig, device: torch.device) -> torch.device:
    """The device this rank works on: ``cuda`` names no GPU, so a rank takes its own (``LOCAL_RANK``, else
    its rank), as the backends place it; ``torch.cuda.set_device`` refuses a device without an index."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", config.device_index)
    return device


class RankGroup:
    """The role's ranks: the process group, the model wrapping, and the collectives the backend needs.

    ``RankGroup(config, device)`` joins the group (it returns once all ``world_size`` ranks have joined)."""

    def __init__(self, config: DistributedConfig, device: torch.device) -> None:
        import torch.distributed as dist

        self.config = config
        self.rank, self.world_size = config.rank, config.world_size
        backend = config.backend
        if backend == "auto":
            backend = "nccl" if device.type == "cuda" else "gloo"
        self.backend = backend
        host, _, port = config.master_address.rpartition(":")
        timeout = datetime.timedelta(seconds=config.timeout_s)
        device = rank_device(config, device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend, init_method=f"tcp://{host}:{port}", rank=self.rank, world_size=self.world_size, timeout=timeout
        )
        # Commands and shares are Python objects: on a gloo group (NCCL moves tensors on devices only).
        self._control = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
        # Where tensors travel on the default group: NCCL's on the rank's GPU, gloo's on the CPU.
        self._transport = device if backend == "nccl" else torch.device("cpu")
        log.info("joined the trainer's ranks", extra={"rank": self.rank, "world_size": self.world_size})

    @property
    def leads(self) -> bool:
        return self.rank == 0

    @property
    def strategy(self) -> str:
        return self.config.strategy

    # -- the model -----------------------------------------------------------------------

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module to run forward on: FSDP2 shards ``model`` in place (and returns it); DDP wraps it."""
        if self.strategy == "fsdp":
            return self.shard(model)
        from torch.nn.parallel import DistributedDataParallel

        device = next(model.parameters()).device
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)

    def shard(self, model: torch.nn.Module) -> torch.nn.Module:
        """FSDP2 over ``model``: each of its decoder layers a unit, then the rest (a frozen model too)."""
        from torch.distributed.fsdp import fully_shard

        layers = set(getattr(model, "_no_split_modules", None) or ())
        for module in model.modules():
            if module is not model and type(module).__name__ in layers:
                fully_shard(module)
        fully_shard(model)
        return model

    @staticmethod
    def reshard(model: torch.nn.Module) -> None:
        """Frees whatever FSDP2 holds gathered in ``model`` (its root keeps its weights gathered after a forward
        that had no backward), so that its parameters are the sharded DTensors again."""
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def frozen(self, model: torch.nn.Module) -> torch.nn.Module:
        """A model that only runs forward (the reference): sharded with FSDP2, replicated with DDP."""
        return self.shard(model) if self.strategy == "fsdp" else model

    @contextlib.contextmanager
    def accumulating(self, module: torch.nn.Module, last: bool) -> Iterator[None]:
        """Around a micro-batch's backward: DDP reduces the gradients only at the last one."""
        if self.strategy == "ddp" and not last:
            with module.no_sync():  # type: ignore[operator]  # DistributedDataParallel.no_sync
                yield
        else:
            yield

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The full weights by their names, on rank 0 (on the CPU with FSDP2; the others get {}). With FSDP2
        a collective: every rank calls it."""
        if self.strategy == "ddp":
            return {name: t.detach() for name, t in model.state_dict().items()} if self.leads else {}
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return {name: t for name, t in state.items() if isinstance(t, torch.Tensor)}

    def full_optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state as one process keys it (``optimizer.state_dict()``), on rank 0; every rank
        calls it."""
        if self.strategy == "ddp":
            return optimizer.state_dict() if self.leads else {}
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        by_name = get_optimizer_state_dict(
            model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        return keyed_by_index(by_name, parameter_names(model, optimizer)) if self.leads else {}

    def load_optimizer_state(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]
    ) -> None:
        """Loads a state written by :meth:`full_optimizer_state` (or by one process) on every rank."""
        if self.strategy == "ddp":
            optimizer.load_state_dict(dict(state))
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        by_name = keyed_by_name(state, parameter_names(model, optimizer))
        set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))

    # -- the control plane ---------------------------------------------------------------

    def send(self, command: str, payload: Any = None) -> None:
        """Rank 0: tells every rank what to do next (they are in :meth:`receive`)."""
        self._broadcast([command, payload])

    def receive(self) -> tuple[str, Any]:
        """The other ranks: the next command of rank 0 (blocks until it comes, or its collective fails)."""
        command, payload = self._broadcast([None, None])
        return str(command), payload

    def agree(self, value: Any) -> Any:
        """Rank 0's ``value``, on every rank."""
        return self._broadcast([value])[0]

    def overwrite_with_leaders(self, tensors: Iterable[torch.Tensor]) -> None:
        """Every rank's ``tensors`` (the same names, shapes and order everywhere: a model's state_dict before
        it is wrapped) become rank 0's, in place: one broadcast each, no pickling."""
        import torch.distributed as dist

        for tensor in tensors:
            if tensor.device == self._transport:
                dist.broadcast(tensor, src=0)
            else:
                moved = tensor.to(self._transport)
                dist.broadcast(moved, src=0)
                tensor.copy_(moved)

    def share(self, value: Any) -> Any:
        """Rank 0's ``value`` (dicts, lists and tuples holding tensors and plain objects: a checkpoint's
        state), on every rank, its tensors on the CPU. The structure travels pickled, the tensors one
        broadcast each, so that the size of a model's optimizer state costs no pickle."""
        import torch.distributed as dist

        tensors: list[torch.Tensor] = []

        def hollow(v: Any) -> Any:
            if not isinstance(v, torch.Tensor):
                return v
            tensors.append(v)
            return _TensorSlot(len(tensors) - 1, tuple(v.shape), v.dtype)

        skeleton = self.agree(_map_leaves(value, hollow) if self.leads else None)
        slots: list[_TensorSlot] = []
        _map_leaves(skeleton, lambda v: slots.append(v) if isinstance(v, _TensorSlot) else None)
        received: dict[int, torch.Tensor] = {}
        for slot in slots:  # in the order hollow numbered them, on every rank
            if self.leads:
                buffer = tensors[slot.index].to(self._transport)
            else:
                buffer = torch.empty(slot.shape, dtype=slot.dtype, device=self._transport)
            dist.broadcast(buffer, src=0)
            received[slot.index] = buffer.cpu()
        if self.leads:
            return value
        return _map_leaves(skeleton, lambda v: received[v.index] if isinstance(v, _TensorSlot) else v)

    def scatter(self, shares: Sequence[Any] | None) -> Any:
        """Rank 0 passes one object per rank; every rank gets its own."""
        import torch.distributed as dist

        out: list[Any] = [None]
        dist.scatter_object_list(
            out, list(shares) if self.leads and shares is not None else None, src=0, group=self._control
        )
        return out[0]

    def gather(self, value: Any) -> list[Any] | None:
        """Every rank's ``value``, in rank order, on rank 0 (None on the others)."""
        import torch.distributed as dist

        out: list[Any] | None = [None] * self.world_size if self.leads else None
        dist.gather_object(value, out, dst=0, group=self._control)
        return out

    def most(self, n: int) -> int:
        """The largest ``n`` of any rank."""
        import torch.distributed as dist

        value = torch.tensor([n], dtype=torch.int64)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self._control)
        return int(value.item())

    def sum(self, totals: Mapping[str, float]) -> dict[str, float]:
        """Every rank's ``totals`` added up, key by key (a key that some rank lacks counts 0 there)."""
        import torch.distributed as dist

        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, dict(totals), group=self._control)
        out: dict[str, float] = {}
        for part in everyone:
            for key, value in part.items():
                out[key] = out.get(key, 0.0) + float(value)
        return out

    def _broadcast(self, objects: list[Any]) -> list[Any]:
        import torch.distributed as dist

        dist.broadcast_object_list(objects, src=0, group=self._control)
        return objects

    def close(self) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            return
        # Leave together: a rank that tears its group down while a peer still uses it (rank 0 hosts the
        # rendezvous store) could abort the other at exit ("terminate called without an active exception").
        with contextlib.suppress(RuntimeError):  # a peer already gone: leave alone
            dist.monitored_barrier(group=self._control, timeout=datetime.timedelta(seconds=CLOSE_TIMEOUT_S))
        dist.destroy_process_group()


@dataclass(frozen=True)
class _TensorSlot:
    """Where :meth:`RankGroup.share` puts a tensor in the pickled structure: which one, and its shape."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def _map_leaves(value: Any, fn: Callable[[Any], Any]) -> Any:
    """``value`` with ``fn`` applied to every leaf of its dicts, lists and tuples (in their order)."""
    if isinstance(value, dict):
        return {k: _map_leaves(v, fn) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_map_leaves(v, fn) for v in value)
    return fn(value)


def parameter_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each parameter in the order the optimizer numbers them (group after group)."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def keyed_by_index(state: Mapping[str, Any], names: list[str]) -> dict[str, Any]:
    """An optimizer state keyed by parameter name (``keyed_by_name``) keyed by index again, as
    ``optimizer.state_dict()`` keys it."""
    index = {name: i for i, name in enumerate(names)}
    return {
        "state": {index[name]: value for name, value in state["state"].items()},
        "param_groups": [
            {**group, "params": [index[name] for name in group["params"]]} for group in state["param_groups"]
        ],
    }


def keyed_by_name(state: Mapping[str, Any], names: list[str]) -> dict[str, Any]:
    """``optimizer.state_dict()`` with its parameters named (``names``: :func:`parameter_names`)."""
    return {
        "state": {names[int(i)]: value for i, value in state["state"].items()},
        "param_groups": [
            {**group, "params": [names[int(i)] for i in group["params"]]} for group in state["param_groups"]
        ],
    }
