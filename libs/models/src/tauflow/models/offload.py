"""A model's parameters in host memory while it waits: colocated mode (docs/gpu.md), where a trainer and an
engine share one GPU and take turns. The engine offloads its weights while the trainer steps; the trainer
offloads its weights while the engine generates (verl's "sleep" and "wake up", slime's offload)."""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch


def sharded_local(tensor: torch.Tensor) -> torch.Tensor | None:
    """The local shard of a DTensor (FSDP2's parameters and their optimizer state), None for a plain tensor."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else None


def tensor_to_host(value: torch.Tensor, host: torch.Tensor | None) -> torch.Tensor:
    """Copies ``value`` into ``host`` (its buffer from an earlier offload; a new one, pinned for a GPU, when it is
    None or no longer fits) and returns the buffer. The copy is stream-ordered: call :func:`hand_back` before
    the device memory goes to another process."""
    if host is None or host.shape != value.shape or host.dtype != value.dtype:
        host = torch.empty(value.shape, dtype=value.dtype, pin_memory=value.is_cuda)
    host.copy_(value, non_blocking=value.is_cuda)
    return host


def hand_back(gpus: set[torch.device]) -> None:
    """After offloads from ``gpus``: waits for their host copies, then returns the freed blocks to the driver,
    where another process (the colocated engine or trainer) can have them."""
    for device in gpus:
        torch.cuda.synchronize(device)
    if gpus:
        torch.cuda.empty_cache()


def storage_to_host(local: torch.Tensor, host: torch.Tensor | None) -> torch.Tensor:
    """Copies the whole storage under ``local`` into ``host`` (a byte buffer; a new one, pinned for a GPU, when
    it is None or of another size) and frees the storage in place: every tensor viewing it stays (a DTensor,
    FSDP2's padded shard), without its bytes until :func:`storage_to_device`. The buffer is returned."""
    storage = local.untyped_storage()
    if not storage.resizable():
        raise RuntimeError(f"the storage of a {tuple(local.shape)} tensor cannot be freed in place (not resizable)")
    if host is None or host.numel() != storage.nbytes():
        host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=local.is_cuda)
    device_bytes = torch.empty(0, dtype=torch.uint8, device=local.device).set_(storage)
    host.copy_(device_bytes, non_blocking=local.is_cuda)  # (stream-ordered before any reuse of the freed block)
    storage.resize_(0)
    return host


def storage_to_device(local: torch.Tensor, host: torch.Tensor) -> None:
    """Gives the storage under ``local`` its bytes back from ``host`` (what :func:`storage_to_host` took)."""
    storage = local.untyped_storage()
    storage.resize_(host.numel())
    torch.empty(0, dtype=torch.uint8, device=local.device).set_(storage).copy_(host, non_blocking=True)


class ParameterOffload:
    """Moves the parameters of some modules to host memory and back, keeping the Parameter objects.

    ``to_host`` copies each parameter's values into a host buffer of its own (pinned when the parameter is on
    a GPU; kept, so that later offloads allocate nothing) and points the parameter at an empty tensor on its
    device: its device memory is freed, and on a GPU handed back to the driver (``torch.cuda.empty_cache``),
    where another process can have it. ``to_device`` copies the values back. The Parameter objects stay what
    they were, so optimizers, hooks and tied weights (one Parameter under two names) go on working; while
    offloaded, a parameter's shape reads ``(0,)`` and nothing may run the modules.

    ``adopt(param, tensor)`` points an offloaded parameter at a tensor that replaces its values anyway (a
    weight update: the new version's copy becomes the parameter); nothing is copied back for it.

    A sharded parameter (FSDP2's DTensor, whose local shard is a view of FSDP2's own padded buffer) cannot be
    re-pointed: its storage is emptied in place instead and refilled by ``to_device`` (its shape stays).

    Thread-safe: the three methods take one lock. On a CPU the "host" is the device, so an offload saves
    nothing there; it behaves the same (copies both ways), which is what lets CPU tests check it.
    """

    def __init__(self, modules: Iterable[torch.nn.Module]) -> None:
        self.modules = list(modules)
        by_id: dict[int, torch.nn.Parameter] = {}
        for module in self.modules:
            for param in module.parameters():
                by_id.setdefault(id(param), param)
        self._params = list(by_id.values())
        self._host: dict[int, torch.Tensor] = {}  # id of the parameter -> its host buffer
        self._offloaded: dict[int, torch.nn.Parameter] = {}
        self._lock = threading.Lock()
        self.offloads = 0  # times to_host moved something

    @property
    def offloaded(self) -> bool:
        """Whether any parameter is in host memory now."""
        with self._lock:
            return bool(self._offloaded)

    @property
    def offloaded_bytes(self) -> int:
        """The bytes of the parameters in host memory now."""
        with self._lock:
            return sum(self._host[i].numel() * self._host[i].element_size() for i in self._offloaded)

    def to_host(self) -> int:
        """Moves every parameter still on its device to host memory; the bytes moved."""
        moved = 0
        gpus: set[torch.device] = set()
        with self._lock:
            for param in self._params:
                key = id(param)
                if key in self._offloaded:
                    continue
                data = param.data
                local = sharded_local(data)
                if local is not None:  # emptied in place: FSDP2 keeps views of the storage
                    if local.untyped_storage().nbytes() == 0:
                        continue  # (nothing held, or a storage another parameter shares and took already)
                    host = self._host[key] = storage_to_host(local, self._host.get(key))
                    self._offloaded[key] = param
                    moved += host.numel()
                    if local.is_cuda:
                        gpus.add(local.device)
                    continue
                # (a stream-ordered copy: the device block freed below is reused only by later work)
                host = self._host[key] = tensor_to_host(data, self._host.get(key))
                param.data = torch.empty(0, dtype=data.dtype, device=data.device)
                self._offloaded[key] = param
                moved += data.numel() * data.element_size()
                if data.is_cuda:
                    gpus.add(data.device)
            if moved:
                self.offloads += 1
        hand_back(gpus)
        return moved

    def to_device(self) -> int:
        """Copies every offloaded parameter back to its device; the bytes moved."""
        moved = 0
        with self._lock:
            for key, param in self._offloaded.items():
                host = self._host[key]
                local = sharded_local(param.data)
                if local is not None:
                    storage_to_device(local, host)
                    moved += host.numel()
                    continue
                # a copy on a CPU too (not the buffer itself), so that CPU tests see what a GPU does
                param.data = host.to(param.device, non_blocking=True, copy=True)
                moved += host.numel() * host.element_size()
            self._offloaded.clear()
        return moved

    def adopt(self, param: torch.nn.Parameter, tensor: torch.Tensor) -> bool:
        """If ``param`` is offloaded, points it at ``tensor`` (its new values: the same shape and dtype, on its
        device) and returns True; False when it is on its device (the caller copies the values into it)."""
        with self._lock:
            key = id(param)
            if key not in self._offloaded:
                return False
            host = self._host[key]
            if sharded_local(param.data) is not None:
                raise ValueError("a sharded (DTensor) parameter cannot adopt a tensor; to_device brings it back")
            if tensor.is_inference():
                raise ValueError("an inference-mode tensor cannot become a parameter (in-place updates would fail)")
            if tensor.shape != host.shape or tensor.dtype != host.dtype or tensor.device != param.device:
                raise ValueError(
                    f"a {tensor.dtype} {tuple(tensor.shape)} tensor on {tensor.device} cannot replace a "
                    f"{host.dtype} {tuple(host.shape)} parameter on {param.device}"
                )
            param.data = tensor
            del self._offloaded[key]
            return True
