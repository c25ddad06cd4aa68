"""Log-probs and entropy from vocabulary-parallel logits (tauflow.trainer.megatron.vocab_parallel): on two gloo
ranks, each holding half of the vocabulary's logits, the same values and the same gradients as
``logprobs_of_logits`` over the whole logits, with a temperature and banned tokens in either half."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tauflow.trainer.batch import PackedBatch, Sample, logprobs_of_logits, pack

VOCAB = 12
BANNED = (2, 9)  # one in each rank's half


def a_batch() -> PackedBatch:
    samples = [
        Sample([1, 5, 7], [3, 11, 6, 0], [-1.0] * 4),
        Sample([4], [8, 10], [-1.0] * 2),
        Sample([6, 6], [5], [-1.0]),
    ]
    return pack(samples, pad_token_id=0, banned_ids=BANNED)


def full_logits(batch: PackedBatch) -> torch.Tensor:
    torch.manual_seed(3)
    return 3 * torch.randn(*batch.input_ids.shape, VOCAB, dtype=torch.float64).float()


def weighted(logprobs: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
    """A loss that weighs every token's log-prob and entropy differently (so each one's gradient is checked)."""
    w = torch.linspace(-1.0, 2.0, logprobs.numel()).view_as(logprobs)
    return (w * logprobs).sum() + (w.flip(-1) * entropy).sum()


def _rank(rank: int, world: int, port: int, out: Path) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from tauflow.trainer.megatron.vocab_parallel import vocab_parallel_logprobs

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(2, 1)
    batch = a_batch()
    width = VOCAB // 2
    mine = full_logits(batch)[..., rank * width : (rank + 1) * width].clone().requires_grad_(True)
    lp = vocab_parallel_logprobs(
        mine, batch, vocab_start=rank * width, temperature=0.7, with_entropy=True, entropy_grad=True
    )
    assert lp.entropy is not None
    weighted(lp.logprobs, lp.entropy).backward()
    assert mine.grad is not None
    grads: list[torch.Tensor | None] = [None, None]
    dist.all_gather_object(grads, mine.grad)
    if rank == 0:
        out.write_bytes(pickle.dumps({"logprobs": lp.logprobs.detach(), "entropy": lp.entropy.detach(),
                                      "grad": torch.cat([g for g in grads if g is not None], dim=-1)}))  # fmt: skip
    dist.destroy_process_group()


def test_two_ranks_each_with_half_the_vocabulary_give_the_whole_logits_log_probs_entropy_and_gradients(
    spawn_ranks: Callable[..., None], tmp_path: Path
) -> None:
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (the trainer's megatron extra)")
    out = tmp_path / "seen.pkl"
    spawn_ranks(_rank, 2, out, timeout_s=120)
    seen = pickle.loads(out.read_bytes())

    batch = a_batch()
    logits = full_logits(batch).requires_grad_(True)
    expected = logprobs_of_logits(logits, batch, temperature=0.7, with_entropy=True, entropy_grad=True)
    assert expected.entropy is not None
    weighted(expected.logprobs, expected.entropy).backward()
    assert torch.allclose(seen["logprobs"], expected.logprobs, atol=1e-5)
    assert torch.allclose(seen["entropy"], expected.entropy, atol=1e-5)
    assert logits.grad is not None
    assert torch.allclose(seen["grad"], logits.grad, atol=1e-5)
    assert float(logits.grad[..., list(BANNED)].abs().max()) == 0.0  # (a banned token takes no gradient)
