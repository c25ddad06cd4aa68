"""A shim, not a product path: megatron-core's real forward and backward on a machine without CUDA, for the
trainer's tests and the pipeline benchmark (bench/pipeline_schedule.py). megatron-core makes a few buffers on
``torch.cuda.current_device()``, forks a CUDA RNG state around dropout, and copies a tied embedding to the
last pipeline stage through ``.cuda()``; the megatron backend refuses ``device: cpu`` (users train it on
CUDA). The shim points the first at the CPU, makes the fork a no-op, skips the copy (the weights the backend
loads next replace it) and lets the backend take the CPU."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch


def run_megatron_on_cpu(set_attribute: Callable[[Any, str, Any], None] = setattr) -> None:
    """Applies the shim with ``set_attribute`` (``setattr``, or a test's ``monkeypatch.setattr`` to undo it)."""
    from megatron.core import tensor_parallel
    from megatron.core.models.common.language_module.language_module import LanguageModule

    import tauflow.trainer.megatron.backend as megatron_backend

    set_attribute(torch.cuda, "current_device", lambda: "cpu")
    set_attribute(tensor_parallel.get_cuda_rng_tracker(), "fork", lambda *a, **k: contextlib.nullcontext())
    set_attribute(LanguageModule, "_is_in_embd_group", lambda self: False)
    set_attribute(megatron_backend, "require_cuda", lambda device: None)
