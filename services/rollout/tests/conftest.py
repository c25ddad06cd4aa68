"""A tiny random Qwen2 saved with save_pretrained and loaded back by the engine with from_pretrained."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

TINY = dict(
    vocab_size=16,
    hidden_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    intermediate_size=64,
    max_position_embeddings=64,
    eos_token_id=2,
    bos_token_id=1,
    pad_token_id=0,
)


def tiny_model(seed: int) -> torch.nn.Module:
    """The tiny Qwen2 with weight matrices drawn wider than the default init, so distributions are peaked and
    depend on the prompt (the default init gives almost uniform next-token distributions)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**TINY))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    return model.eval()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-qwen2")
    tiny_model(0).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def reference(model_dir: Path) -> torch.nn.Module:
    """The same checkpoint loaded independently, for full (no-cache) recomputation."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


@pytest.fixture
def engine(model_dir: Path) -> Iterator[object]:
    from tauflow.rollout.engine.hf import HFEngine

    eng = HFEngine.from_pretrained(model_dir, seed=1234)
    yield eng
    eng.close()


def _full_logprobs(model: torch.nn.Module, prompt: list[int], completion: list[int], temperature: float) -> list[float]:
    """log_softmax(logits / T) of each completion token, from one forward over prompt + completion without a cache."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].float()
    logp = torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), dim=-1)
    n = len(prompt)
    return [logp[n - 1 + i, t].item() for i, t in enumerate(completion)]


@pytest.fixture(scope="session")
def full_logprobs():
    return _full_logprobs


@pytest.fixture(scope="session")
def make_model():
    return tiny_model
