"""TorchBackend: steps and versions, never training a group twice, micro-batching, schedules, checkpoints."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tauflow.trainer.backend import TorchBackend, TorchBackendConfig
from tauflow.trainer.batch import Group, Sample
from tauflow.trainer.checkpoint import (
    STATE_JSON,
    checkpoint_to_resume,
    latest_checkpoint,
    list_checkpoints,
    read_checkpoint_meta,
)
from tauflow.trainer.optim import OptimConfig, lr_factor

MakeGroups = Callable[..., list[Group]]


def config(model_dir: Path, **kw: object) -> TorchBackendConfig:
    kw.setdefault("optim", OptimConfig(lr=1e-2, weight_decay=0.01, schedule="cosine", warmup_steps=2, total_steps=10))
    return TorchBackendConfig(model_path=str(model_dir), **kw)


def params(backend: TorchBackend) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in backend.model.state_dict().items()}


def test_a_step_is_a_version_and_reports_metrics(tiny_model_dir: Path, make_groups: MakeGroups) -> None:
    b = TorchBackend(config(tiny_model_dir))
    before = params(b)
    groups = make_groups(0, 3)
    r = b.train_step(groups)
    assert (r.step, r.policy_version, r.committed, b.version) == (0, 1, True, 1)
    assert r.groups == 3 and r.samples == 12
    assert r.trained_tokens == sum(s.trained_tokens for g in groups for s in g.samples)
    assert r.mean_reward == pytest.approx(sum(s.reward for g in groups for s in g.samples) / 12)
    keys = ("clip_fraction", "is_weight_mean", "is_truncated_fraction", "kl_behaviour", "entropy", "grad_norm", "lr")
    for key in keys:
        assert math.isfinite(r.metrics[key]), key
    assert r.metrics["clip_fraction"] == 0.0  # one update per batch: prox = current, the ratio is 1
    assert r.metrics["lr"] == pytest.approx(1e-2 * 0.5)  # first of two warmup steps
    assert r.metrics["is_truncated_fraction"] > 0  # behaviour log-probs of ~-3 vs a near-uniform ~-2.8
    assert any(not torch.equal(before[k], v) for k, v in params(b).items())
    assert b.trained_group_ids == {g.group_id for g in groups}


def test_never_trains_a_group_twice(tiny_model_dir: Path, make_groups: MakeGroups) -> None:
    b = TorchBackend(config(tiny_model_dir))
    g1, g2 = make_groups(0, 2)
    b.train_step([g1])
    snapshot = params(b)
    again = b.train_step([g1, g1])
    assert not again.committed and again.policy_version == 1 and b.version == 1
    assert again.skipped_duplicate_group_ids == ["g0-0", "g0-0"]
    assert all(torch.equal(snapshot[k], v) for k, v in params(b).items())
    mixed = b.train_step([g1, g2])
    assert mixed.committed and mixed.groups == 1 and mixed.trained_group_ids == ["g0-1"]
    assert mixed.metrics["skipped_duplicate_groups"] == 1 and b.version == 2


def test_zero_advantage_groups_are_skipped_but_the_step_commits(tiny_model_dir: Path) -> None:
    b = TorchBackend(config(tiny_model_dir, optim=OptimConfig(lr=1e-2, weight_decay=0.1)))
    flat = Group("flat", [Sample([1, 2], [3, 4], [-2.0, -2.0], reward=1.0) for _ in range(4)])
    before = params(b)
    r = b.train_step([flat])
    assert r.committed and b.version == 1 and r.trained_tokens == 0
    assert r.metrics["skipped_zero_advantage_groups"] == 1 and r.metrics["micro_batches"] == 0
    # a zero gradient's AdamW update, as the formula's (and verl's) backward makes it: momentum 0 at the first
    # step, so only the decoupled weight decay moves the matrices (lr · wd); the vectors have no decay
    for k, v in params(b).items():
        decayed = before[k] * (1 - 1e-2 * 0.1) if before[k].ndim >= 2 else before[k]
        assert torch.allclose(v, decayed, rtol=0, atol=1e-7), k
    assert r.metrics["updates"] == 1 and r.metrics["grad_norm"] == 0.0
    varied = Group("varied", [Sample([1, 2], [3, 4], [-2.0, -2.0], reward=float(i % 2)) for i in range(4)])
    r = b.train_step([Group("flat2", flat.samples), varied])
    assert r.groups == 2 and r.metrics["skipped_zero_advantage_groups"] == 1 and r.trained_tokens == 8


def test_groups_no_step_can_train_are_skipped_and_the_others_train(tiny_model_dir: Path) -> None:
    # A token id outside the vocabulary (the embedding's lookup raised and ended the trainer, each restart handed
    # the group again) or a reward whose square overflows (the step's loss and every group's update were NaN).
    b = TorchBackend(config(tiny_model_dir))
    vocab = b.model.config.vocab_size

    def group(name: str, completion: list[int], reward: float = 1.0) -> Group:
        n = len(completion)
        return Group(name, [Sample([1, 2], completion, [-2.0] * n, reward=reward * (i % 2)) for i in range(4)])

    positions = b.model.config.max_position_embeddings
    poison = [group("oov", [3, vocab]), group("negative", [3, -1]), group("huge", [3, 4], reward=1.7e308),
              group("long", [3] * (positions - 1))]  # fmt: skip
    r = b.train_step([group("ok", [3, 4]), group("longest", [3] * (positions - 2)), *poison])
    assert r.committed and r.groups == 2 and r.trained_group_ids == ["ok", "longest"]
    assert r.metrics["skipped_invalid_groups"] == 4 and math.isfinite(r.loss) and math.isfinite(r.metrics["grad_norm"])
    alone = b.train_step([group("oov2", [vocab + 7, 3])])  # nothing else: nothing trains, nothing commits
    assert not alone.committed and alone.metrics["skipped_invalid_groups"] == 1 and b.version == 1
    # a RoPE model trained past its context on purpose: max_sample_tokens 0 lifts the bound (a rope_scaling
    # factor raises it by itself)
    unbounded = TorchBackend(config(tiny_model_dir, max_sample_tokens=0))
    assert unbounded.train_step([group("long2", [3] * (positions + 10))]).trained_group_ids == ["long2"]
    b.model.config.rope_scaling = {"rope_type": "yarn", "factor": 4.0}
    assert TorchBackend._max_positions.func(b) == 4 * positions  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "options",
    [
        {"aggregation": "token-mean"},
        {"aggregation": "seq-mean-token-mean", "mini_batches": 2},
        {"aggregation": "token-mean", "mini_batches": 3, "epochs": 2},
        {"aggregation": "seq-mean-token-sum-norm"},
        {"aggregation": "sample-sum"},
        {"algorithm": "gpg"},
        {"kl_coef": 0.1, "entropy_coef": 0.01},
    ],
)
def test_skipping_zero_advantage_groups_changes_no_update(tiny_model_dir: Path, options: dict[str, object]) -> None:
    # The published formulas (DeepSeekMath's, verl's token mean, GPG's α = B / B_valid) average over every
    # sample of the batch, a zero group's too: skipping its forward must not change a denominator (it scaled
    # every other token's gradient by all tokens / those kept, 3x here), nor drop its KL and entropy terms.
    def batch() -> list[Group]:
        def group(name: str, rewards: list[float], length: int) -> Group:
            return Group(
                name, [Sample([1, 2], [3 + i % 4] * length, [-2.0] * length, reward=r) for i, r in enumerate(rewards)]
            )

        # (with mini_batches 2, the first mini-batch holds zero groups alone: its update is a zero gradient's,
        # which still moves Adam's momentum, and weight decay)
        return [group("ones", [1, 1, 1, 1], 5), group("zeros", [0, 0, 0, 0], 2), group("varied", [1, 0, 1, 0], 3)]

    algorithm = str(options.get("algorithm", "grpo"))
    algorithm_options = {k: v for k, v in options.items() if k != "algorithm"}
    updated = {}
    for skip in (True, False):
        # Adam with eps 1: the update ~ the gradient; weight decay: an update of a zero gradient still decays
        optim = OptimConfig(lr=1.0, eps=1.0, grad_clip=None, weight_decay=0.01)
        b = TorchBackend(
            config(
                tiny_model_dir,
                optim=optim,
                algorithm=algorithm,
                algorithm_options={**algorithm_options, "skip_zero_advantage_groups": skip},
            )
        )
        r = b.train_step(batch())
        updated[skip] = (params(b), r)
    (skipping, r_skip), (all_run, r_all) = updated[True], updated[False]
    computes_nothing_else = "kl_coef" not in options
    assert r_skip.metrics["skipped_zero_advantage_groups"] == (2 if computes_nothing_else else 0)
    assert r_skip.metrics["pg_loss"] == pytest.approx(r_all.metrics["pg_loss"], rel=1e-5, abs=1e-8)
    for k in skipping:
        assert torch.allclose(skipping[k], all_run[k], atol=1e-6), k


def test_stale_groups_are_dropped_not_recorded(tiny_model_dir: Path, make_groups: MakeGroups) -> None:
    b = TorchBackend(config(tiny_model_dir))
    for i in range(3):
        b.train_step(make_groups(10 + i, 1, version=i))
    old, fresh = make_groups(20, 1, prefix="old", version=0), make_groups(21, 1, prefix="new", version=2)
    r = b.train_step(old + fresh, max_staleness=1)  # step 3: staleness 3 and 1
    assert r.skipped_stale_group_ids == [old[0].group_id] and r.trained_group_ids == [fresh[0].group_id]
    assert r.max_staleness == 1 and old[0].group_id not in b.trained_group_ids


def test_micro_batching_is_gradient_accumulation(tiny_model_dir: Path, make_groups: MakeGroups) -> None:
    groups = make_groups(3, 4)
    results = {}
    for mode in ("token-mean", "seq-mean-token-mean", "sample-sum"):
        for budget in (8, 100_000):
            # Adam's first step is g/(|g| + eps): with eps = 1 the update is ~ the gradient itself, so the
            # comparison below compares gradients (with a small eps, Adam would blow float noise up to ±lr)
            optim = OptimConfig(lr=1.0, eps=1.0, grad_clip=None)
            b = TorchBackend(
                config(tiny_model_dir, optim=optim, micro_batch_tokens=budget, algorithm_options={"aggregation": mode})
            )
            r = b.train_step(groups)
            results[mode, budget] = (params(b), r)
        (small, r_small), (big, r_big) = results[mode, 8], results[mode, 100_000]
        assert r_small.metrics["micro_batches"] > 1 and r_big.metrics["micro_batches"] == 1
        assert r_small.loss == pytest.approx(r_big.loss, rel=1e-5, abs=1e-7)
        assert r_small.metrics["grad_norm"] == pytest.approx(r_big.metrics["grad_norm"], rel=1e-4)
        for k in small:
            assert torch.allclose(small[k], big[k], atol=1e-6), (mode, k)


def test_lr_schedule() -> None:
    cos = OptimConfig(lr=1.0, schedule="cosine", warmup_steps=2, total_steps=6, min_lr_ratio=0.1)

    # warmup (k+1)/2: 0.5, 1.0; then 0.1 + 0.9·(1 + cos(pi·(k-2)/4))/2 for k = 2..6, flat after
    def cosine(k: int) -> float:
        return 0.1 + 0.9 * (1 + math.cos(math.pi * (k - 2) / 4)) / 2

    expected = [0.5, 1.0, cosine(2), cosine(3), cosine(4), cosine(5), 0.1, 0.1]
    assert cosine(2) == 1.0 and cosine(4) == pytest.approx(0.55) and cosine(6) == pytest.approx(0.1)
    assert [lr_factor(k, cos) for k in range(8)] == pytest.approx(expected)
    assert [lr_factor(k, OptimConfig(warmup_steps=4)) for k in range(6)] == pytest.approx([0.25, 0.5, 0.75, 1, 1, 1])
    with pytest.raises(ValueError, match="total_steps"):
        OptimConfig(schedule="cosine")


def test_checkpoint_resume_is_bitwise_exact(tiny_model_dir: Path, make_groups: MakeGroups, tmp_path: Path) -> None:
    batches = [make_groups(100 + k, 2) for k in range(5)]
    a = TorchBackend(config(tiny_model_dir))
    for batch in batches[:3]:
        a.train_step(batch)
    info = a.save_checkpoint(tmp_path / "ckpt")
    assert info.policy_version == 3 and info.trained_groups == 6 and info.path.name == "v00000003"
    torch.manual_seed(1234)  # whatever happens to the global RNG after the save is restored on load
    for batch in batches[3:]:
        a.train_step(batch)
    params_a = params(a)

    b = TorchBackend(config(tiny_model_dir))
    b.train_step(make_groups(999, 1))  # a fresh backend that has moved on: load replaces all of it
    b.load_checkpoint(tmp_path / "ckpt")  # the directory of checkpoints: the newest is taken
    assert b.version == 3 and b.trained_group_ids == {g.group_id for batch in batches[:3] for g in batch}
    assert b.lr == pytest.approx(a.config.optim.lr * lr_factor(3, a.config.optim))
    torch.manual_seed(1234)
    for batch in batches[3:]:
        b.train_step(batch)
    params_b = params(b)
    assert b.version == a.version == 5
    assert params_a.keys() == params_b.keys()
    for k in params_a:
        assert torch.equal(params_a[k], params_b[k]), k

    c = TorchBackend(config(tiny_model_dir), checkpoint=info.path)  # resume at construction
    assert c.version == 3 and not c.train_step(batches[0]).committed


def test_a_damaged_checkpoint_is_refused_naming_its_file(
    tiny_model_dir: Path, make_groups: MakeGroups, tmp_path: Path
) -> None:
    b = TorchBackend(config(tiny_model_dir))
    b.train_step(make_groups(0, 2))
    info = b.save_checkpoint(tmp_path)
    state = info.path / STATE_JSON
    state.write_text(state.read_text()[:100])  # torn
    with pytest.raises(ValueError, match=r"trainer_state.json is damaged .*move that checkpoint folder aside"):
        TorchBackend(config(tiny_model_dir), checkpoint=info.path)


def test_a_newest_checkpoint_without_its_state_file_is_refused_not_passed_over(
    tiny_model_dir: Path, make_groups: MakeGroups, tmp_path: Path
) -> None:
    """A checkpoint is renamed into place only whole, so a newest folder without trainer_state.json is damage:
    resuming from the one before without a word lost the steps after it (a fault probe: 12 acked groups neither
    trained nor in the queue). An older one (a prune cut short) is passed over."""
    b = TorchBackend(config(tiny_model_dir))
    saved = []
    for step in range(3):
        b.train_step(make_groups(step, 2))
        saved.append(b.save_checkpoint(tmp_path).path)
    assert checkpoint_to_resume(tmp_path) == saved[-1]
    (saved[0] / STATE_JSON).unlink()  # older: passed over
    assert checkpoint_to_resume(tmp_path) == saved[-1]
    (saved[-1] / STATE_JSON).unlink()  # the newest: refused, naming it
    with pytest.raises(ValueError, match=rf"{saved[-1].name}/trainer_state.json is missing .*move that checkpoint"):
        checkpoint_to_resume(tmp_path)
    assert latest_checkpoint(tmp_path) == saved[1]  # (what listing the complete ones still says)
    assert checkpoint_to_resume(tmp_path / "none") is None


def test_a_flipped_byte_in_any_checkpoint_file_is_refused_before_it_is_loaded(
    tiny_model_dir: Path, make_groups: MakeGroups, tmp_path: Path
) -> None:
    b = TorchBackend(config(tiny_model_dir))
    b.train_step(make_groups(0, 2))
    info = b.save_checkpoint(tmp_path)
    listed = json.loads((info.path / STATE_JSON).read_text())["files"]
    assert {"model.safetensors", "trainer_state.pt", "config.json"} <= listed.keys()
    for name in ("model.safetensors", "trainer_state.pt"):
        file = info.path / name
        whole = file.read_bytes()
        middle = len(whole) // 2  # (a tensor's bytes: both files still load without the check)
        file.write_bytes(whole[:middle] + bytes([whole[middle] ^ 1]) + whole[middle + 1 :])
        with pytest.raises(ValueError, match=rf"{name} is damaged \(its sha256 .*move that checkpoint folder aside"):
            TorchBackend(config(tiny_model_dir), checkpoint=info.path)
        with pytest.raises(ValueError, match=rf"{name} is damaged"):
            b.load_checkpoint(info.path)
        file.write_bytes(whole[:-1])  # cut short: its size
        with pytest.raises(ValueError, match=rf"{name} is damaged \({len(whole) - 1} bytes, written as {len(whole)}"):
            TorchBackend(config(tiny_model_dir), checkpoint=info.path)
        file.write_bytes(whole)
    assert TorchBackend(config(tiny_model_dir), checkpoint=info.path).version == 1

    # without checksums: the sizes only (no read back)
    fast = TorchBackend(config(tiny_model_dir, checkpoint_checksums=False))
    fast.train_step(make_groups(0, 2))
    written = fast.save_checkpoint(tmp_path / "fast")
    assert all("sha256" not in f for f in json.loads((written.path / STATE_JSON).read_text())["files"].values())
    (written.path / "config.json").unlink()
    with pytest.raises(ValueError, match=r"config.json is damaged \(missing\)"):
        TorchBackend(config(tiny_model_dir), checkpoint=written.path)

    # a checkpoint written before the files were listed (format 1, no digest of its own) still resumes
    meta = json.loads((info.path / STATE_JSON).read_text())
    del meta["files"], meta["digest"]
    (info.path / STATE_JSON).write_text(json.dumps({**meta, "format": 1}))
    assert TorchBackend(config(tiny_model_dir), checkpoint=info.path).version == 1


def test_any_flipped_bit_of_trainer_state_json_is_refused_naming_it(
    tiny_model_dir: Path, make_groups: MakeGroups, tmp_path: Path
) -> None:
    """The file that says which version a resume starts from was the one file without a check: a flipped bit
    of its "policy_version" (30 to 70) skipped 40 steps without a word, one of its key "files" turned every
    file's check off, one of "trained_group_ids" ended the resume in a bare KeyError."""
    b = TorchBackend(config(tiny_model_dir))
    b.train_step(make_groups(0, 2))
    info = b.save_checkpoint(tmp_path)
    state = info.path / STATE_JSON
    whole = state.read_bytes()
    assert read_checkpoint_meta(info.path)["policy_version"] == 1
    for at in range(len(whole)):  # every byte, one bit of it (a different bit from byte to byte)
        flipped = whole[:at] + bytes([whole[at] ^ (1 << (at % 8))]) + whole[at + 1 :]
        with contextlib.suppress(ValueError):
            if json.loads(flipped) == json.loads(whole):
                continue  # the same document (1e-05 written 1E-05): nothing to refuse
        state.write_bytes(flipped)
        with pytest.raises(ValueError, match=r"trainer_state.json is damaged|checkpoint format"):
            read_checkpoint_meta(info.path)
    state.write_bytes(whole)
    for field, value in [("policy_version", 70), ("trained_group_ids", ["other"]), ("created_at", 0.0)]:
        changed = json.loads(whole)
        changed[field] = value  # (valid JSON, every key there: only the digest tells)
        state.write_text(json.dumps(changed))
        with pytest.raises(ValueError, match=r"damaged \(its fields are not the ones written"):
            TorchBackend(config(tiny_model_dir), checkpoint=info.path)
    # a format 1 document (no digest) is still checked field by field: its version is its folder's
    old = {k: v for k, v in json.loads(whole).items() if k != "digest"}
    for changed, why in [
        ({**old, "format": 1, "policy_version": 70}, "policy_version 70 is not its folder's, 1"),
        ({k: v for k, v in old.items() if k != "trained_group_ids"} | {"format": 1}, "trained_group_ids is not"),
        ({**old, "format": 1, "policy_version": "1"}, "policy_version is '1', not a version"),
    ]:
        state.write_text(json.dumps(changed))
        with pytest.raises(ValueError, match=rf"trainer_state.json is damaged \({why}"):
            TorchBackend(config(tiny_model_dir), checkpoint=info.path)
    state.write_bytes(whole)
    assert TorchBackend(config(tiny_model_dir), checkpoint=info.path).version == 1


def test_a_checkpoint_write_that_fills_the_disk_says_so_as_enospc(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On a full disk torch.save raises RuntimeError ("unexpected pos", "file write failed") and safetensors its
    # own error: the trainer waits out ENOSPC (loop.py), so a full disk must reach it as one.
    import errno
    from collections import namedtuple

    import tauflow.trainer.checkpoint as checkpoint_module

    def failing_save(*args: object, **kwargs: object) -> None:
        raise RuntimeError("[enforce fail at inline_container.cc:858] . PytorchStreamWriter failed writing file")

    monkeypatch.setattr(checkpoint_module.torch, "save", failing_save)
    b = TorchBackend(config(tiny_model_dir))
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(checkpoint_module.shutil, "disk_usage", lambda path: usage(10**9, 10**9, 4096))
    with pytest.raises(OSError) as full:
        b.save_checkpoint(tmp_path / "full")
    assert full.value.errno == errno.ENOSPC and "PytorchStreamWriter" in str(full.value)
    monkeypatch.setattr(checkpoint_module.shutil, "disk_usage", lambda path: usage(10**12, 0, 10**12))
    with pytest.raises(RuntimeError, match="PytorchStreamWriter"):  # room on the disk: another failure, as it is
        b.save_checkpoint(tmp_path / "room")
    assert not list((tmp_path / "room").iterdir())  # (nothing half-written left)


def test_rng_state_is_restored(tiny_model_dir: Path, tmp_path: Path) -> None:
    import random

    b = TorchBackend(config(tiny_model_dir))
    info = b.save_checkpoint(tmp_path)
    expected = (torch.rand(3), random.random())
    torch.manual_seed(7)
    random.seed(7)
    TorchBackend(config(tiny_model_dir), checkpoint=info.path)
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]


def test_checkpoint_layout_is_loadable_atomic_and_pruned(
    tiny_model_dir: Path, make_groups: MakeGroups, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForCausalLM

    b = TorchBackend(config(tiny_model_dir, keep_checkpoints=2))
    root = tmp_path / "ckpts"
    first = b.save_checkpoint(root)
    assert b.save_checkpoint(root).created_at == first.created_at  # same version: returned as it is
    for k in range(3):
        b.train_step(make_groups(k, 1))
        b.save_checkpoint(root)
    assert [p.name for p in list_checkpoints(root)] == ["v00000002", "v00000003"]
    latest = latest_checkpoint(root)
    assert latest is not None
    names = {p.name for p in latest.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer_config.json", STATE_JSON, "trainer_state.pt"} <= names
    meta = json.loads((latest / STATE_JSON).read_text())
    assert meta["policy_version"] == 3 and meta["algorithm"] == "grpo" and len(meta["trained_group_ids"]) == 3

    hf = AutoModelForCausalLM.from_pretrained(latest)  # plain Hugging Face loading of the checkpoint folder
    published = b.state_dict_for_publish()
    for name, tensor in hf.state_dict().items():
        assert torch.equal(tensor, published[name]), name
    assert "model.embed_tokens.weight" in published and "lm_head.weight" in published

    def boom(*args: object, **kw: object) -> None:
        raise OSError("disk full")

    b.train_step(make_groups(50, 1))
    monkeypatch.setattr(torch, "save", boom)
    with pytest.raises(OSError, match="disk full"):
        b.save_checkpoint(root)
    assert [p.name for p in sorted(root.iterdir())] == ["v00000002", "v00000003"]  # nothing half-written


def test_kl_to_the_in_process_reference(tiny_model_dir: Path, make_groups: MakeGroups) -> None:
    b = TorchBackend(config(tiny_model_dir, algorithm_options={"kl_coef": 0.1}))
    assert b.ref_model is not None and not any(p.requires_grad for p in b.ref_model.parameters())
    first = b.train_step(make_groups(0, 2))
    assert first.metrics["kl_ref"] == pytest.approx(0.0, abs=1e-9)  # version 0 is the reference
    later = [b.train_step(make_groups(k, 2)) for k in range(1, 4)]
    assert later[-1].metrics["kl_ref"] > 0


def test_sft_step_lowers_the_nll(tiny_model_dir: Path) -> None:
    b = TorchBackend(config(tiny_model_dir, optim=OptimConfig(lr=1e-2)))
    data = [Sample([1, 2], [3, 4, 5], [0.0] * 3, loss_mask=[True, True, False]), Sample([6], [7, 8], [0.0] * 2)]
    losses = [b.sft_step(data).loss for _ in range(5)]
    assert b.version == 5 and losses[-1] < losses[0]


def test_logits_in_chunks_train_as_the_whole_logits_do(tiny_model_dir: Path, make_groups: MakeGroups) -> None:
    # backend.logits_chunk_tokens through a step of two updates (π_prox and the reference's log-probs before
    # the first, the entropy bonus's gradient) and an SFT step: the same metrics and weights
    options = {"kl_coef": 0.1, "entropy_coef": 0.01, "mini_batches": 2, "epochs": 1}
    sft = [Sample([1, 2], [3, 4, 5], [0.0] * 3), Sample([6], [7, 8], [0.0] * 2)]
    runs = []
    for chunk in (0, 3):
        b = TorchBackend(config(tiny_model_dir, algorithm_options=options, logits_chunk_tokens=chunk))
        steps = [b.train_step(make_groups(k, 3)) for k in range(2)] + [b.sft_step(sft)]
        runs.append((params(b), steps))
    (whole, whole_steps), (chunked, chunked_steps) = runs
    for mine, theirs in zip(chunked_steps, whole_steps, strict=True):
        assert mine.loss == pytest.approx(theirs.loss, rel=1e-5, abs=1e-7)
        assert mine.metrics.keys() == theirs.metrics.keys()
        for key, value in theirs.metrics.items():
            assert mine.metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    assert whole_steps[1].metrics["kl_ref"] > 0
    # (AdamW's division turns rounding in near-zero gradients into moves of up to ~1e-5, a key bias's most,
    # since its gradient is 0 up to rounding: 2e-6 on one up_proj element on some CPUs; a wrong gradient moves
    # weights by the learning rate, 1e-2)
    for k in whole:
        assert torch.allclose(chunked[k], whole[k], atol=1e-4 if "k_proj.bias" in k else 1e-5), k
    with pytest.raises(ValueError, match="logits_chunk_tokens"):
        config(tiny_model_dir, logits_chunk_tokens=-1)


@pytest.mark.gpu
def test_cuda_bf16_autocast_step_and_resume(tiny_model_dir: Path, make_groups: MakeGroups, tmp_path: Path) -> None:
    b = TorchBackend(config(tiny_model_dir, device="cuda", autocast_dtype="bfloat16"))
    seen: list[torch.dtype] = []
    hook = b.model.get_output_embeddings().register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    try:
        r = b.train_step(make_groups(0, 2))
    finally:
        hook.remove()
    assert seen and set(seen) == {torch.bfloat16}, seen  # the step's forwards ran under bfloat16 autocast
    assert r.committed and math.isfinite(r.loss) and next(b.model.parameters()).dtype == torch.float32
    info = b.save_checkpoint(tmp_path)
    c = TorchBackend(config(tiny_model_dir, device="cuda"), checkpoint=info.path)
    assert c.version == 1 and next(c.model.parameters()).is_cuda


def test_an_offloaded_model_steps_publishes_and_checkpoints_as_a_resident_one(
    tiny_model_dir: Path, make_groups: MakeGroups, tmp_path: Path
) -> None:
    # offload_model and offload_optimizer (colocated mode): between steps every model of the process (here the
    # policy and the KL's reference) and the policy's AdamW moments wait in host memory; each command brings
    # the weights back, each update the moments, and the run is the same run.
    opts = {"optim": OptimConfig(lr=1e-2), "algorithm_options": {"kl_coef": 0.1}}
    plain = TorchBackend(config(tiny_model_dir, **opts))
    offloaded = TorchBackend(config(tiny_model_dir, offload_model=True, offload_optimizer=True, **opts))
    assert plain.release_memory() == 0  # (without offload_model: nothing moves)
    weights = {id(p): p for m in (offloaded.model, offloaded.ref_model) for p in m.parameters()}
    total = sum(p.numel() * p.element_size() for p in weights.values())
    policy_floats = sum(p.numel() for p in offloaded.model.parameters())
    for step in range(3):
        groups = make_groups(step, 2)
        a, b = plain.train_step(groups), offloaded.train_step(groups)
        assert b.loss == pytest.approx(a.loss, rel=1e-6, abs=1e-8) and b.metrics["kl_ref"] == pytest.approx(
            a.metrics["kl_ref"], rel=1e-5, abs=1e-9
        )
        assert offloaded._offload is not None and offloaded._offload.offloaded_bytes == 2 * 4 * policy_floats
        assert offloaded.release_memory() == total
        assert all(p.numel() == 0 for p in weights.values())
        published = offloaded.state_dict_for_publish(torch.bfloat16)  # a command: the weights come back
        expected = plain.state_dict_for_publish(torch.bfloat16)
        assert all(torch.equal(published[n], t) for n, t in expected.items())
        offloaded.release_memory()
    info = offloaded.save_checkpoint(tmp_path)  # offloaded when asked
    resumed = TorchBackend(config(tiny_model_dir, **opts), checkpoint=info.path)
    for n, t in plain.model.state_dict().items():
        torch.testing.assert_close(resumed.model.state_dict()[n], t, rtol=0, atol=0, msg=n)
    plain.train_step(make_groups(3, 2))  # the moments saved from host memory: the next update is the same
    resumed.train_step(make_groups(3, 2))
    for n, t in plain.model.state_dict().items():
        torch.testing.assert_close(resumed.model.state_dict()[n], t, rtol=0, atol=1e-7, msg=n)
    with pytest.raises(ValueError, match="offload_model needs kind: torch"):
        config(tiny_model_dir, offload_model=True, kind="megatron", device="cuda")


@pytest.mark.gpu
def test_cuda_offloaded_optimizer_state_leaves_the_gpu_between_updates_and_trains_alike(
    tiny_model_dir: Path, make_groups: MakeGroups, tmp_path: Path
) -> None:
    opts = {"device": "cuda", "optim": OptimConfig(lr=1e-2)}
    plain, offloaded = (
        TorchBackend(config(tiny_model_dir, **opts)),
        TorchBackend(config(tiny_model_dir, offload_optimizer=True, **opts)),
    )
    for step in range(3):
        groups = make_groups(step, 2)
        plain.train_step(groups)
        offloaded.train_step(groups)
    params = sum(p.numel() for p in offloaded.model.parameters())
    moments = [v for state in offloaded.optimizer.state.values() for v in state.values() if v.dim() > 0]
    assert moments and all(v.device.type == "cpu" and v.is_pinned() for v in moments)
    assert offloaded._offload is not None and offloaded._offload.offloaded_bytes == 2 * 4 * params  # AdamW's moments
    # what the GPU holds back: moving the state back costs that much device memory again
    before = torch.cuda.memory_allocated()
    offloaded._offload.to_device()
    assert torch.cuda.memory_allocated() - before >= 2 * 4 * params
    offloaded._offload.to_host()
    for a, b in zip(plain.model.parameters(), offloaded.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)  # the same three updates
    # a resumed backend keeps the state off the GPU too, from the start
    resumed = TorchBackend(
        config(tiny_model_dir, offload_optimizer=True, **opts), checkpoint=offloaded.save_checkpoint(tmp_path).path
    )
    assert all(v.device.type == "cpu" for state in resumed.optimizer.state.values() for v in state.values())
    resumed.train_step(make_groups(3, 2))


@pytest.mark.gpu
def test_cuda_an_offloaded_model_and_optimizer_leave_the_gpu_while_the_trainer_waits(
    tiny_model_dir: Path, make_groups: MakeGroups
) -> None:
    opts = {"device": "cuda", "optim": OptimConfig(lr=1e-2), "offload_optimizer": True, "offload_model": True}
    b = TorchBackend(config(tiny_model_dir, **opts))
    weight_bytes = sum(p.numel() * p.element_size() for p in b.model.parameters())
    for step in range(2):
        assert b.train_step(make_groups(step, 2)).committed
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        assert b.release_memory() == weight_bytes
        assert torch.cuda.memory_allocated() <= before - weight_bytes
        assert b._model_offload is not None and all(buf.is_pinned() for buf in b._model_offload._host.values())
    assert all(p.is_cuda for p in b.model.parameters())  # (empty: the device stays, for their return)


# ------------------------------------------------------------------------------- PPO updates in a step


def test_mini_batches_and_epochs_make_the_clip_bind_in_one_version(
    tiny_model_dir: Path, make_groups: MakeGroups
) -> None:
    groups = make_groups(5, 4)
    opts = {"algorithm_options": {"mini_batches": 2, "epochs": 2}, "optim": OptimConfig(lr=5e-2, schedule="constant")}
    b = TorchBackend(config(tiny_model_dir, **opts))
    r = b.train_step(groups)
    # four optimizer updates, one policy version, one step of the schedule
    assert (r.policy_version, b.version, r.metrics["updates"]) == (1, 1, 4.0)
    assert b.scheduler.last_epoch == 1
    # the proximal policy is the weights before the first update: from the second update on, the ratio moves
    # and the clip binds; the first update alone (one mini-batch, one epoch) never clips
    assert r.metrics["clip_fraction"] > 0 and r.metrics["ppo_kl"] != 0.0
    assert r.metrics["clip_fraction"] == pytest.approx(r.metrics["clip_fraction_low"] + r.metrics["clip_fraction_high"])
    single = TorchBackend(config(tiny_model_dir, optim=OptimConfig(lr=5e-2, schedule="constant"))).train_step(groups)
    assert single.metrics["clip_fraction"] == 0.0 and single.metrics["ratio_mean"] == pytest.approx(1.0)
    assert single.metrics["updates"] == 1.0


def test_one_mini_batch_of_one_epoch_trains_as_a_single_update(tiny_model_dir: Path, make_groups: MakeGroups) -> None:
    # With the proximal log-probs recomputed (an extra forward) or taken as the current ones (none), a step
    # of one update is the same update: the recomputed pass sees the same weights.
    groups = make_groups(6, 3)
    a = TorchBackend(config(tiny_model_dir))
    a.train_step(groups)
    b = TorchBackend(config(tiny_model_dir))
    plans = [b._micro_batches(mb) for mb in b._plan(groups, b.algorithm, -1).mini_batches]
    proximal = b._logprobs_before(plans, b._forward_model, "proximal_logprobs")
    assert all(torch.isfinite(t).all() for row in proximal for t in row)
    b.train_step(groups)
    for key, value in params(a).items():
        assert torch.equal(value, params(b)[key]), key


def test_proximal_behaviour_uses_the_samplers_log_probs(tiny_model_dir: Path, make_groups: MakeGroups) -> None:
    # proximal = behaviour: the ratio is π_θ / π_behaviour (coupled PPO, no IS weight); behaviour log-probs
    # of ~-3 against a near-uniform model (~-2.8) put most ratios above 1 + 0.2 or below
    groups = make_groups(7, 3)
    b = TorchBackend(config(tiny_model_dir, algorithm_options={"proximal": "behaviour"}))
    r = b.train_step(groups)
    assert r.metrics["is_weight_mean"] == pytest.approx(1.0)
    assert r.metrics["ratio_mean"] != pytest.approx(1.0, abs=1e-3)
    assert r.metrics["clip_fraction"] > 0


@pytest.mark.parametrize(
    "name",
    [
        "rloo",
        "reinforce_pp",
        "reinforce_pp_baseline",
        "grpo_passk",
        "gspo",
        "sapo",
        "cispo",
        "gpg",
        "icepop",
        "dr_grpo",
    ],
)
def test_every_preset_trains_a_step(tiny_model_dir: Path, make_groups: MakeGroups, name: str) -> None:
    b = TorchBackend(config(tiny_model_dir, algorithm=name, algorithm_options={"entropy_coef": 0.01}))
    before = params(b)
    r = b.train_step(make_groups(8, 3))
    assert r.committed and math.isfinite(r.loss) and math.isfinite(r.metrics["grad_norm"])
    assert "entropy_loss" in r.metrics
    assert any(not torch.equal(before[k], v) for k, v in params(b).items()), name


def test_kl_in_the_reward_shapes_the_advantages(tiny_model_dir: Path, make_groups: MakeGroups) -> None:
    from tauflow.trainer.advantages import Scored, estimate
    from tauflow.trainer.losses import kl_estimate

    b = TorchBackend(config(tiny_model_dir, algorithm_options={"kl_reward_coef": 0.5, "estimator": "rloo"}))
    b.train_step(make_groups(1, 3))  # the policy moves away from the reference (the initial model)
    groups = make_groups(2, 3)
    plan = b._plan(groups, b.algorithm, -1)
    pool = [s for g in groups for s in g.samples if s.trained_tokens > 0]
    forward = dict(zip(map(id, pool), b._forward_logprobs(pool, ("prox", "ref")), strict=True))
    for s in pool:  # log π_ref is the initial model's, whatever the policy did
        assert forward[id(s)]["ref"] != pytest.approx(forward[id(s)]["prox"])

    def scored(s: Sample) -> Scored:
        if id(s) not in forward:
            return Scored(s.reward, s.mask)
        f = forward[id(s)]
        kl = kl_estimate(torch.tensor(f["prox"]), torch.tensor(f["ref"]), "k1").tolist()
        return Scored(s.reward, s.mask, [-0.5 * k if m else 0.0 for k, m in zip(kl, s.mask, strict=True)])

    want = estimate([[scored(s) for s in g.samples] for g in groups], b.algorithm.config)
    expected = [
        a
        for g, adv in zip(groups, want.values, strict=True)
        for s, a in zip(g.samples, adv, strict=True)
        if s.trained_tokens > 0
    ]
    assert plan.advantages == pytest.approx(expected, rel=1e-5, abs=1e-7)
    assert plan.kl_reward != 0.0
    assert "kl_reward" in b.train_step(groups).metrics
    unshaped = TorchBackend(config(tiny_model_dir, algorithm_options={"estimator": "rloo"}))
    unshaped.train_step(make_groups(1, 3))
    assert unshaped._plan(groups, unshaped.algorithm, -1).advantages != pytest.approx(plan.advantages)


def test_rejection_drops_samples_far_off_policy_from_the_step(tiny_model_dir: Path, make_groups: MakeGroups) -> None:
    # behaviour log-probs of ~-3 against a near-uniform model (~-2.8): geometric-mean weights of ~1.1-1.6
    groups = make_groups(3, 4)
    kept = TorchBackend(config(tiny_model_dir, algorithm_options={"reject_upper": 100.0})).train_step(groups)
    assert kept.metrics["rejected_samples"] == 0.0
    b = TorchBackend(config(tiny_model_dir, algorithm_options={"reject_upper": 1.3}))
    r = b.train_step(groups)
    assert 0 < r.metrics["rejected_samples"] < r.samples
    assert r.trained_tokens < kept.trained_tokens  # out of the denominators too
    assert r.committed and b.trained_group_ids == {g.group_id for g in groups}


@pytest.mark.parametrize("form", ["advantage", "reverse_kl"])
def test_on_policy_distillation_pulls_the_student_towards_the_teacher(
    form: str, tiny_model_dir: Path, make_groups: MakeGroups, tmp_path: Path
) -> None:
    # A teacher that differs from the student: the tiny model after SFT on a few fixed answers. Distillation
    # steps (advantages log π_teacher − log π_student per token, or the full per-token reverse KL) shrink
    # the reverse KL on the samples, step by step; the outcome reward plays no part.
    teacher = TorchBackend(config(tiny_model_dir, optim=OptimConfig(lr=5e-2, schedule="constant")))
    answers = [Sample([1, 2, 3], [4, 5, 6, 7], [0.0] * 4, sample_id=str(i)) for i in range(4)]
    for _ in range(8):
        teacher.sft_step(answers)
    teacher.model.save_pretrained(tmp_path / "teacher")
    student = TorchBackend(
        config(
            tiny_model_dir,
            algorithm="opd",
            algorithm_options={"opd_loss": form},
            teacher_model_path=str(tmp_path / "teacher"),
            optim=OptimConfig(lr=5e-2, schedule="constant"),
        )
    )
    groups = make_groups(11, 4)
    gaps = []
    for k in range(8):
        batch = [Group(f"{g.group_id}-{k}", g.samples) for g in groups]  # the same samples, fresh ids
        r = student.train_step(batch)
        gaps.append(r.metrics["kl_teacher"])
        if form == "reverse_kl":  # the loss is the KL itself; the sampled tokens' advantages are all 0
            assert r.metrics["distill_loss"] > 0 and r.metrics["advantage_mean"] == 0.0
    assert gaps[0] > 0.1, gaps  # the student starts far from the teacher ...
    assert gaps[-1] < 0.5 * gaps[0], gaps  # ... and distillation halves the gap within eight steps
    with pytest.raises(ValueError, match="teacher_model_path"):  # when the config loads
        config(tiny_model_dir, algorithm="opd")


def test_the_full_kl_trains_every_group_and_compares_the_vocabulary_both_models_have(
    tiny_model_dir: Path, make_groups: MakeGroups, tmp_path: Path
) -> None:
    # A teacher of the same tokenizer whose embeddings are padded further (as Qwen2.5-7B's are against 0.5B):
    # the full KL runs over the rows both have; and with skip_zero_advantage_groups on (its advantages are
    # all 0) every group still trains, since the loss is the KL, not the advantages.
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(3)
    wide = Qwen2ForCausalLM(
        Qwen2Config(vocab_size=16 + 8, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                    num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64)
    )  # fmt: skip
    wide.save_pretrained(tmp_path / "wide")
    student = TorchBackend(
        config(
            tiny_model_dir,
            algorithm="opd",
            algorithm_options={"opd_loss": "reverse_kl", "skip_zero_advantage_groups": True},
            teacher_model_path=str(tmp_path / "wide"),
        )
    )
    result = student.train_step(make_groups(21, 3))
    assert result.metrics["skipped_zero_advantage_groups"] == 0.0 and result.trained_tokens > 0
    assert result.metrics["kl_teacher"] > 0 and math.isfinite(result.metrics["distill_loss"])


def test_the_algorithm_and_its_options_are_checked_when_the_config_loads(tiny_model_dir: Path) -> None:
    from tauflow.core.config import ConfigError, load_config
    from tauflow.trainer.config import TrainerConfig

    for bad, match in (
        ({"algorithm": "nope"}, "unknown algorithm 'nope'"),
        ({"algorithm_options": {"mini_batch": 2}}, "mini_batch"),
        ({"algorithm_options": {"clip_ratio_c": 0.5}}, "clip_ratio_c"),
    ):
        with pytest.raises(ValueError, match=match):
            config(tiny_model_dir, **bad)
    with pytest.raises(ConfigError, match="mini_batch"):
        load_config(
            TrainerConfig, overrides=[f"backend.model_path={tiny_model_dir}", "backend.algorithm_options.mini_batch=2"]
        )


def test_remax_trains_against_the_greedy_baseline_and_skips_groups_without_one(tiny_model_dir: Path) -> None:
    def group(gid: str, baseline: float | None) -> Group:
        samples = [Sample([1, 2], [3, 4], [-2.7, -2.7], reward=float(i % 2), sample_id=str(i)) for i in range(4)]
        return Group(gid, samples, baseline_reward=baseline)

    backend = TorchBackend(config(tiny_model_dir, algorithm="remax"))
    before = params(backend)
    result = backend.train_step([group("with", 0.5), group("without", None)])
    assert result.committed and result.groups == 2
    assert result.metrics["no_baseline_groups"] == 1.0
    assert result.metrics["skipped_zero_advantage_groups"] == 1.0  # the group without a baseline
    assert result.trained_tokens == 8  # the other group's 4 samples x 2 tokens
    assert result.metrics["advantage_mean"] == pytest.approx(0.0)  # ±0.5 around the greedy reward 0.5
    assert any(not torch.equal(before[k], v) for k, v in params(backend).items())


def test_mask_truncated_keeps_a_cut_completion_in_the_baseline_and_out_of_the_loss(tiny_model_dir: Path) -> None:
    """DAPO's overlong filtering: the truncated sample counts in the group's mean but trains nothing, so the
    step equals the same step where that sample's loss mask is all zeros."""
    import dataclasses as dc

    from tauflow.trainer.batch import Group, Sample

    def group(truncated_mask: bool) -> Group:
        samples = [
            Sample([5, 6], [7, 8, 9], [-1.0] * 3, reward=r, sample_id=str(i), truncated=(i == 2))
            for i, r in enumerate([1.0, 0.0, 0.0, 1.0])
        ]
        if truncated_mask:
            samples[2] = dc.replace(samples[2], loss_mask=[False] * 3, truncated=False)
        return Group("g", samples)

    results = []
    for option, masked in ((True, False), (False, True)):
        backend = TorchBackend(config(tiny_model_dir, algorithm_options={"mask_truncated": option}))
        result = backend.train_step([group(masked)])
        results.append((result, params(backend)))
    (masked_run, a), (reference_run, b) = results
    assert (
        masked_run.metrics["masked_truncated_samples"] == 1.0
        and reference_run.metrics["masked_truncated_samples"] == 0.0
    )
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)  # the same update


def test_fp16_mixed_precision_keeps_fp32_master_weights_and_a_loss_scale(tiny_model_dir: Path, make_groups) -> None:
    """float16 autocast (on CPU here): the step trains, the weights and optimizer stay float32, and fp16's
    dynamic loss scale is applied and reported; bfloat16 needs none."""
    fp16 = TorchBackend(config(tiny_model_dir, autocast_dtype="float16"))
    before = params(fp16)
    result = fp16.train_step(make_groups(0, 2))
    assert result.committed and 0 < result.metrics["loss_scale"] <= 65536.0
    assert all(p.dtype == torch.float32 for p in fp16.model.parameters())
    assert any(not torch.equal(before[k], v) for k, v in params(fp16).items())  # it stepped
    bf16 = TorchBackend(config(tiny_model_dir, autocast_dtype="bfloat16"))
    assert "loss_scale" not in bf16.train_step(make_groups(0, 2)).metrics
    with pytest.raises(ValueError, match="float16 with a critic is not supported"):
        TorchBackend(config(tiny_model_dir, autocast_dtype="float16", algorithm="ppo"))


def test_the_generation_budget_is_dr_grpos_constant_unless_set(tiny_model_dir: Path) -> None:
    budget = config(tiny_model_dir, algorithm="dr_grpo", response_tokens=48)
    assert budget.chosen_algorithm().config.loss_scale_factor == 48.0
    assert TorchBackend(budget).algorithm.config.loss_scale_factor == 48.0
    explicit = config(
        tiny_model_dir, algorithm="dr_grpo", response_tokens=48, algorithm_options={"loss_scale_factor": 7}
    )
    assert explicit.chosen_algorithm().config.loss_scale_factor == 7
    assert config(tiny_model_dir, algorithm="dr_grpo").chosen_algorithm().config.loss_scale_factor is None
    with pytest.raises(ValueError, match="response_tokens"):
        config(tiny_model_dir, response_tokens=0)


def test_fp16_with_a_mini_batch_of_zero_advantage_groups_only_steps_on(tiny_model_dir: Path) -> None:
    # Zero groups count in their mini-batch (its denominators), so a mini-batch can hold nothing that trains: no
    # backward, and fp16's GradScaler asserted on unscaling nothing (the trainer failed)
    def group(name: str, rewards: list[float]) -> Group:
        return Group(name, [Sample([1, 2], [3 + i % 4] * 3, [-2.0] * 3, reward=r) for i, r in enumerate(rewards)])

    b = TorchBackend(config(tiny_model_dir, autocast_dtype="float16", algorithm_options={"mini_batches": 2}))
    for batch in (
        [group("ones", [1, 1, 1, 1]), group("zeros", [0, 0, 0, 0]), group("a", [1, 0, 1, 0]), group("b", [0, 1, 1, 0])],
        [
            group("c", [1, 0, 1, 0]),
            group("d", [0, 1, 1, 0]),
            group("ones2", [1, 1, 1, 1]),
            group("zeros2", [0, 0, 0, 0]),
        ],
    ):
        result = b.train_step(batch)
        assert result.committed and result.metrics["updates"] == 2 and result.metrics["loss_scale"] > 0
    assert b.version == 2


def test_a_disk_that_holds_the_kept_checkpoints_and_not_one_more_still_takes_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A new checkpoint is written whole before the old ones go: on a disk with room for `keep` and not one more,
    # no checkpoint was written again (steps trained with nothing durable, every lease held).
    import errno

    import tauflow.trainer.checkpoint as checkpoint_module

    root, room = tmp_path / "checkpoints", 3  # the disk holds three checkpoints

    def save_weights(folder: Path) -> None:
        if len(checkpoint_module.list_checkpoints(root)) >= room:
            raise OSError(errno.ENOSPC, "No space left on device")
        (folder / "weights.bin").write_bytes(b"w" * 64)

    def write(version: int, keep: int) -> None:
        checkpoint_module.write_checkpoint(
            root, version, save_weights=save_weights, tokenizer_source=tmp_path, trainer_state=dict,
            meta={"trained_group_ids": [f"g{version}"]}, keep=keep,
        )  # fmt: skip

    for version in (10, 20, 30, 40, 50):
        write(version, keep=3)
    assert [p.name for p in checkpoint_module.list_checkpoints(root)] == ["v00000030", "v00000040", "v00000050"]
    room = 2  # fewer than kept: the oldest go, one at a time, never the newest whole one
    write(60, keep=3)
    assert [p.name for p in checkpoint_module.list_checkpoints(root)] == ["v00000050", "v00000060"]
    room = 1  # room for one: a full disk, said as one; the last whole checkpoint stays
    with pytest.raises(OSError) as full:
        write(70, keep=3)
    assert full.value.errno == errno.ENOSPC
    assert [p.name for p in checkpoint_module.list_checkpoints(root)] == ["v00000060"]
    assert not list(root.glob(".tmp-*"))
    for keep in (0, 1):  # keep 0 keeps every one, as asked; keep 1 has no older one to spare
        with pytest.raises(OSError):
            write(80 + keep, keep=keep)
    room = 2
    write(90, keep=3)  # [v60, v90]
    room = 1
    monkeypatch.setattr(checkpoint_module.shutil, "rmtree", lambda *a, **k: None)  # (a folder that stays)
    with pytest.raises(OSError) as full:  # said as a full disk, not tried again for ever
        write(100, keep=3)
    assert full.value.errno == errno.ENOSPC


def test_a_resume_with_new_optimizer_settings_trains_with_them(
    tiny_model_dir: Path, make_groups: MakeGroups, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The checkpoint's optimizer state brought its lr, betas, eps and weight decay back: a resume with a new lr
    # trained at the old one, silently, while the new schedule was taken.
    import logging

    old = OptimConfig(lr=1e-2, weight_decay=0.01, schedule="cosine", warmup_steps=2, total_steps=10)
    b = TorchBackend(config(tiny_model_dir, optim=old))
    for seed in range(3):
        b.train_step(make_groups(seed, 2))
    info = b.save_checkpoint(tmp_path)
    new = OptimConfig(lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-6, schedule="cosine", warmup_steps=2,
                      total_steps=10)  # fmt: skip
    with caplog.at_level(logging.WARNING):
        c = TorchBackend(config(tiny_model_dir, optim=new), checkpoint=info.path)
    assert c.scheduler.last_epoch == 3  # (the step count stays the checkpoint's)
    r = c.train_step(make_groups(3, 2))
    assert r.metrics["lr"] == pytest.approx(3e-3 * lr_factor(3, new))
    matrices, vectors = c.optimizer.param_groups
    assert matrices["weight_decay"] == 0.1 and vectors["weight_decay"] == 0.0
    assert matrices["betas"] == (0.9, 0.95) and matrices["eps"] == 1e-6
    assert c.optimizer.state_dict()["state"]  # (the moments stay the checkpoint's)
    changed = [r for r in caplog.records if "optimizer settings differ" in r.getMessage()]
    assert len(changed) == 1 and changed[0].changed["lr"] == [1e-2, 3e-3]  # type: ignore[attr-defined]
    same = TorchBackend(config(tiny_model_dir, optim=old), checkpoint=info.path)  # the same settings: as saved
    assert same.train_step(make_groups(3, 2)).metrics["lr"] == pytest.approx(1e-2 * lr_factor(3, old))


def test_a_checkpoint_starts_no_thread_mid_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Its files were hashed by a pool made at each checkpoint: a thread of it that could not start for want of
    # memory (an address-space limit reached for a moment) left the trainer CHECKPOINTING for good.
    import threading

    import tauflow.trainer.checkpoint as checkpoint_module

    checkpoint_module.hash_pool()  # (the trainer starts it before it serves)
    started: list[str] = []
    real_start = threading.Thread.start

    def start(thread: threading.Thread) -> None:
        started.append(thread.name)
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)

    def save_weights(folder: Path) -> None:
        for k in range(12):
            (folder / f"shard-{k}.bin").write_bytes(bytes([k]) * 4096)

    for version in (1, 2):
        info = checkpoint_module.write_checkpoint(
            tmp_path, version, save_weights=save_weights, tokenizer_source=tmp_path, trainer_state=dict,
            meta={"trained_group_ids": []}, keep=3, checksums=True,
        )  # fmt: skip
        assert checkpoint_module.read_checkpoint_meta(info.path)["files"]["shard-3.bin"]["sha256"]
    assert started == []
