"""The pipeline schedule (tauflow.trainer.megatron.pipeline) on two gloo ranks, each a stage of a plain torch
model (the schedule needs no megatron): a window of W micro-batches runs its forwards before their backwards,
stage by stage, and every micro-batch's log-probs, entropy and every weight's gradient are those of the whole
model in one process, whatever the window."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from tauflow.trainer.batch import PackedBatch, Sample, TokenLogProbs, logprobs_of_logits, pack

VOCAB, HIDDEN = 11, 8
MICRO_BATCHES = 5


class ToyModel(torch.nn.Module):
    """Embedding, two tanh layers, an output layer: stage 0 holds the embedding and the first layer, stage 1
    the second and the output layer (``stage``: None for the whole model)."""

    def __init__(self, stage: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(2)])
        self.output = torch.nn.Linear(HIDDEN, VOCAB)
        self.stage = stage
        self.layout = SimpleNamespace(hidden_size=HIDDEN)
        self.events: list[tuple[str, int]] = []  # ("F", k): micro-batch k's forward; ("B", k): its backward

    def batch_forward(self, batch: PackedBatch, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """As ``MegatronCausalLM.batch_forward``: a stage's output is ``[T, B, H]``, the last one's the logits."""
        self.events.append(("F", sum(e == "F" for e, _ in self.events)))
        if self.stage in (None, 0):
            hidden = self.embed(batch.input_ids).transpose(0, 1)
        assert hidden is not None
        for i, layer in enumerate(self.layers):
            if self.stage is None or self.stage == i:
                hidden = torch.tanh(layer(hidden))
        if self.stage == 0:
            return hidden
        return self.output(hidden.transpose(0, 1))

    def batch_logprobs(self, batch: PackedBatch, hidden: torch.Tensor | None = None, **options: Any) -> TokenLogProbs:
        """As ``MegatronCausalLM.batch_logprobs``: the last stage's log-probs."""
        return logprobs_of_logits(self.batch_forward(batch, hidden), batch, **options)

    def stage_parameters(self) -> dict[str, torch.Tensor]:
        """The parameters this stage holds (and trains), by name."""
        held = ("embed.", "layers.0.") if self.stage == 0 else ("layers.1.", "output.")
        return {n: p for n, p in self.named_parameters() if self.stage is None or n.startswith(held)}


def micro_batches() -> list[PackedBatch]:
    generator = torch.Generator().manual_seed(5)
    out = []
    for k in range(MICRO_BATCHES):
        rows = []
        for _ in range(2 + k % 2):
            prompt = torch.randint(0, VOCAB, (1 + k % 3,), generator=generator).tolist()
            completion = torch.randint(0, VOCAB, (2 + k % 2,), generator=generator).tolist()
            rows.append(Sample(prompt, completion, [-1.0] * len(completion)))
        out.append(pack(rows, pad_token_id=0, advantages=[float(k - 2 + i) for i in range(len(rows))]))
    return out


def loss_of(lp: TokenLogProbs, batch: PackedBatch) -> torch.Tensor:
    """A policy-gradient loss with an entropy bonus (both through the broadcast values)."""
    assert lp.entropy is not None
    mask = batch.loss_mask.float()
    return -((lp.logprobs * batch.advantages + 0.1 * lp.entropy) * mask).sum()


def one_process() -> dict[str, Any]:
    model = ToyModel()
    values = []
    for batch in micro_batches():
        lp = logprobs_of_logits(model.batch_forward(batch), batch, with_entropy=True, entropy_grad=True)
        loss_of(lp, batch).backward()
        values.append((lp.logprobs.detach(), lp.entropy.detach() if lp.entropy is not None else None))
    return {"values": values, "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}}


WINDOWS = (1, 2, 3)  # the stages taking turns; windows that divide 5 micro-batches, and that do not


def _stage_rank(rank: int, world: int, port: int, out: Path) -> None:
    import torch.distributed as dist

    from tauflow.trainer.megatron.pipeline import PipelineStage, pipeline_logprobs

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    stage = PipelineStage(rank, dist.group.WORLD, torch.device("cpu"))
    runs = {}
    for window in WINDOWS:
        model = ToyModel(stage=rank)
        values = []
        batches = micro_batches()
        for k, batch in enumerate(batches):  # as the trainer's step: a window's forwards, then each one's backward
            if k % window == 0:
                lps = pipeline_logprobs(model, batches[k : k + window], stage, with_entropy=True, entropy_grad=True)
            lp = lps[k % window]
            loss_of(lp, batch).backward()
            model.events.append(("B", k))  # (stage 0: once the gradient came back from stage 1)
            values.append((lp.logprobs.detach(), lp.entropy.detach() if lp.entropy is not None else None))
        held = model.stage_parameters()
        runs[window] = {
            "events": model.events,
            "values": values,
            "grads": {n: p.grad.clone() for n, p in held.items() if p.grad is not None},
            "untouched": [n for n, p in model.named_parameters() if n not in held and p.grad is not None],
        }
    out.with_suffix(f".{rank}").write_bytes(pickle.dumps(runs))
    dist.destroy_process_group()


def test_a_window_of_micro_batches_runs_forwards_then_backwards_and_gives_one_process_gradients(
    spawn_ranks: Callable[..., None], tmp_path: Path
) -> None:
    spawn_ranks(_stage_rank, 2, tmp_path / "stage", timeout_s=120)
    ranks = [pickle.loads((tmp_path / f"stage.{rank}").read_bytes()) for rank in range(2)]
    whole = one_process()
    for window in WINDOWS:
        stages = [runs[window] for runs in ranks]
        # the schedule: each window's forwards (W micro-batches, the last window what is left), then their backwards
        expected: list[tuple[str, int]] = []
        for start in range(0, MICRO_BATCHES, window):
            ks = range(start, min(start + window, MICRO_BATCHES))
            expected += [("F", k) for k in ks] + [("B", k) for k in ks]
        assert stages[0]["events"] == expected, window
        for stage in stages:  # both stages: the last stage's values, broadcast
            for (logprobs, entropy), (want_lp, want_entropy) in zip(stage["values"], whole["values"], strict=True):
                torch.testing.assert_close(logprobs, want_lp, rtol=0, atol=1e-6)
                torch.testing.assert_close(entropy, want_entropy, rtol=0, atol=1e-6)
            assert stage["untouched"] == []  # no stage trained another's layers
        grads = {**stages[0]["grads"], **stages[1]["grads"]}
        assert grads.keys() == whole["grads"].keys()
        for name, grad in whole[
            "grads"
        ].items():  # every weight's, the first stage's through the hidden states sent back
            assert grad.abs().max() > 0, name
            torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=f"{name} (window {window})")
