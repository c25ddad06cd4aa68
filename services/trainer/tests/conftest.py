"""Shared fixtures: one thread, and a tiny random Qwen2 model saved as a Hugging Face folder."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tauflow.trainer.batch import Group, Sample

torch.set_num_threads(1)

VOCAB = 16


def tiny_qwen2(seed: int = 0) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    return Qwen2ForCausalLM(config)


@pytest.fixture(name="tiny_qwen2")
def tiny_qwen2_factory() -> Callable[..., torch.nn.Module]:
    """``tiny_qwen2(seed)``: a fresh tiny random Qwen2ForCausalLM (vocab 16, hidden 32, one layer)."""
    return tiny_qwen2


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-qwen2")
    tiny_qwen2().save_pretrained(path)
    (path / "tokenizer_config.json").write_text("{}")  # stands in for the tokenizer files a checkpoint copies
    return path


@pytest.fixture
def make_groups() -> Callable[..., list[Group]]:
    """``make_groups(seed, n, size=4, prefix="g", version=0)``: groups of random samples and rewards."""

    def make(seed: int, n: int, size: int = 4, prefix: str = "g", version: int = 0) -> list[Group]:
        rng = random.Random(seed)
        groups = []
        for gi in range(n):
            prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 4))]
            samples = []
            for si in range(size):
                c = rng.randint(1, 5)
                samples.append(
                    Sample(
                        prompt_ids=prompt,
                        completion_ids=[rng.randrange(1, VOCAB) for _ in range(c)],
                        behaviour_logprobs=[-rng.uniform(2.0, 3.5) for _ in range(c)],
                        loss_mask=[rng.random() > 0.2 for _ in range(c)] if si % 2 else None,
                        reward=float(rng.random() > 0.5) + si * 0.01,
                        behaviour_version=version,
                        sample_id=str(si),
                    )
                )
            groups.append(Group(f"{prefix}{seed}-{gi}", samples))
        return groups

    return make


@pytest.fixture
def megatron_world(tmp_path: Path) -> Iterator[None]:
    """A one-rank world with megatron's model-parallel state (TP = PP = 1): gloo, or the world a megatron
    backend made already in this process (kept)."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (the trainer's megatron extra)")
    import torch.distributed as dist
    from megatron.core import parallel_state

    if dist.is_initialized():
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(1, 1)
        yield
        return
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.fixture
def megatron_on_cpu(megatron_world: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The megatron CPU shim (tauflow.trainer.megatron.cpu_shim: a test shim, not a product path) for this
    test: megatron-core's real forward and backward on the CPU."""
    from tauflow.trainer.megatron.cpu_shim import run_megatron_on_cpu

    run_megatron_on_cpu(monkeypatch.setattr)


@pytest.fixture(name="spawn_ranks")
def spawn_ranks_factory() -> Callable[..., None]:
    """``spawn_ranks(target, world, *args)``: ``target(rank, world, port, *args)`` in ``world`` processes of their
    own (spawned: a module-level ``target``), ``port`` a free one on loopback for their process group; asserts
    each exited 0 within ``timeout_s`` (a keyword, 240 by default)."""

    def spawn(target: Callable[..., None], world: int, *args: Any, timeout_s: float = 240) -> None:
        import multiprocessing
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        context = multiprocessing.get_context("spawn")
        procs = [context.Process(target=target, args=(rank, world, port, *args)) for rank in range(world)]
        try:
            for p in procs:
                p.start()
            deadline = time.monotonic() + timeout_s
            # (one deadline for all; a rank that failed ends the wait: the others may hang in a collective for it)
            while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
                if any(p.exitcode not in (None, 0) for p in procs):
                    break
                time.sleep(0.1)
            codes = [p.exitcode for p in procs]
        finally:  # (pytest-timeout interrupting the wait too: no rank outlives its test, holding a GPU or a port)
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(10)
        assert codes == [0] * world, codes

    return spawn
