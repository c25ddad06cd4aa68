"""The megatron backend: megatron-core's GPTModel built from a Hugging Face folder holds its weights (published
and saved in Hugging Face names, loadable by from_pretrained); TP = PP = 1 gives the torch backend's loss on
the same batch over three steps and checkpoints resume: on a GPU (marked gpu), and on the CPU under the
conftest's shim (megatron-core's hard-coded CUDA device pointed at the CPU; float32 only)."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tauflow.trainer.backend import TorchBackend, TorchBackendConfig, backend_class
from tauflow.trainer.batch import Group
from tauflow.trainer.optim import OptimConfig

MakeGroups = Callable[..., list[Group]]


def config(model_dir: Path, **kw: Any) -> TorchBackendConfig:
    kw.setdefault("optim", OptimConfig(lr=1e-2, schedule="constant"))
    return TorchBackendConfig(model_path=str(model_dir), **kw)


def test_the_config_names_the_backend_and_refuses_what_it_cannot_run(tiny_model_dir: Path) -> None:
    assert backend_class(config(tiny_model_dir)) is TorchBackend
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (the trainer's megatron extra)")
    from tauflow.trainer.megatron.backend import MegatronBackend, init_megatron

    assert backend_class(config(tiny_model_dir, kind="megatron")) is MegatronBackend
    with pytest.raises(ValueError, match="need kind: megatron"):
        config(tiny_model_dir, tensor_parallel=2)
    with pytest.raises(ValueError, match="kind must be"):
        config(tiny_model_dir, kind="jax")
    with pytest.raises(ValueError, match="pipeline_micro_batches_in_flight needs pipeline_parallel > 1"):
        config(tiny_model_dir, kind="megatron", pipeline_micro_batches_in_flight=2)
    with pytest.raises(ValueError, match="pipeline_micro_batches_in_flight must be at least 0"):
        config(tiny_model_dir, kind="megatron", pipeline_micro_batches_in_flight=-1)
    with pytest.raises(ValueError, match="need as many ranks"):
        init_megatron(torch.device("cpu"), tensor_parallel=2)
    with pytest.raises(ValueError, match="must divide the trainer.s world size"):
        MegatronBackend(config(tiny_model_dir, kind="megatron", device="cuda", tensor_parallel=2))
    with pytest.raises(ValueError, match=r"\(1 x 2\) must divide the trainer.s world size"):
        MegatronBackend(config(tiny_model_dir, kind="megatron", device="cuda", pipeline_parallel=2))
    with pytest.raises(ValueError, match="full KL with pipeline_parallel"):
        MegatronBackend(
            config(tiny_model_dir, kind="megatron", device="cuda", pipeline_parallel=2, algorithm="opd",
                   algorithm_options={"opd_loss": "reverse_kl"}, teacher_model_path=str(tiny_model_dir))
        )  # fmt: skip
    with pytest.raises(ValueError, match="padding_side: right"):
        MegatronBackend(config(tiny_model_dir, kind="megatron", padding_side="left"))
    with pytest.raises(ValueError, match="needs a CUDA device"):
        MegatronBackend(config(tiny_model_dir, kind="megatron", device="cpu"))


def test_the_gpt_model_holds_the_folders_weights_in_hugging_face_names(
    megatron_world: None, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    from tauflow.trainer.megatron.backend import MegatronCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    model = MegatronCausalLM.from_pretrained(tiny_model_dir)
    published = model.hf_state_dict()
    assert published.keys() == reference.keys()
    for name, t in reference.items():
        assert torch.equal(published[name], t), name
    with torch.no_grad():
        next(model.gpt.parameters()).add_(1.0)  # a trained weight: saved as trained
    model.save_pretrained(tmp_path / "saved")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved").state_dict()
    for name, t in model.hf_state_dict().items():
        assert torch.equal(reloaded[name], t), name
    assert not torch.equal(reloaded["model.embed_tokens.weight"], reference["model.embed_tokens.weight"])


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request: pytest.FixtureRequest) -> str:
    """Where the megatron backend runs: a GPU, or the CPU under the conftest's shim."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (the trainer's megatron extra)")
    if request.param == "cpu":
        request.getfixturevalue("megatron_on_cpu")
    return str(request.param)


@pytest.mark.parametrize(("autocast", "tolerance"), [(None, 1e-4), ("bfloat16", 2e-2)], ids=["fp32", "bf16"])
def test_megatron_tp1_gives_the_torch_backends_loss(
    device: str, tiny_model_dir: Path, make_groups: MakeGroups, autocast: str | None, tolerance: float
) -> None:
    from tauflow.trainer.megatron.backend import MegatronBackend

    if device == "cpu" and autocast is not None:
        pytest.skip("bfloat16 autocast is checked on a GPU only (float32 on the CPU)")
    options = {"device": device, "autocast_dtype": autocast}
    torch_backend = TorchBackend(config(tiny_model_dir, **options))
    megatron = MegatronBackend(config(tiny_model_dir, kind="megatron", **options))
    for seed in range(3):  # the first step from the same weights, then steps from weights each trained alike
        groups = make_groups(seed, 2)
        a, b = torch_backend.train_step(groups), megatron.train_step(groups)
        assert a.committed and b.committed
        assert b.loss == pytest.approx(a.loss, abs=tolerance), seed
    published = megatron.state_dict_for_publish()
    # AdamW moves a weight by at most ~lr a step whatever its gradient: a gradient that is 0 up to rounding (a
    # key bias's; in bfloat16, any small one) may move it the other way in the other backend, up to 2 lr a
    # step. Those are held to that bound (3 steps at 1e-2); the rest, in float32, to 50 times the loss's.
    loose = 6e-2
    for name, t in torch_backend.state_dict_for_publish().items():
        atol = loose if autocast or name.endswith("k_proj.bias") else 50 * tolerance
        assert torch.allclose(published[name].float(), t.float(), atol=atol), name


def test_megatron_checkpoints_resume(
    device: str, tiny_model_dir: Path, make_groups: MakeGroups, tmp_path: Path
) -> None:
    from tauflow.trainer.megatron.backend import MegatronBackend

    autocast = "bfloat16" if device == "cuda" else None
    cfg = config(tiny_model_dir, kind="megatron", device=device, autocast_dtype=autocast)
    first = MegatronBackend(cfg)
    first.train_step(make_groups(0, 2))
    info = first.save_checkpoint(tmp_path)
    resumed = MegatronBackend(cfg, checkpoint=info.path)
    assert resumed.version == 1
    for name, t in first.state_dict_for_publish().items():
        assert torch.equal(resumed.state_dict_for_publish()[name], t), name
    groups = make_groups(1, 2, prefix="h")
    assert resumed.train_step(groups).loss == pytest.approx(first.train_step(groups).loss, abs=1e-6)


# -- tensor and pipeline parallelism: gloo ranks on the CPU under the shim, against one process ---------------------


def _model_parallel_rank(rank: int, world: int, port: int, job: dict[str, Any], out: Path) -> None:
    """One rank of a tensor- or pipeline-parallel megatron trainer (rank 0 leads, the others follow), under the
    CPU shim (in this process); rank 0 writes what it saw."""
    import tauflow.trainer.megatron.backend as megatron_backend
    from tauflow.trainer.megatron.cpu_shim import run_megatron_on_cpu
    from tauflow.trainer.parallel import DistributedConfig, RankGroup

    torch.set_num_threads(1)
    run_megatron_on_cpu()
    megatron_backend.GRAD_BUCKET_BYTES = 4096  # (several buckets of gradients per all-reduce, even for this model)
    dist = DistributedConfig(world, rank, f"127.0.0.1:{port}", timeout_s=120, keepalive_s=60)
    group = RankGroup(dist, torch.device("cpu"))
    backend = megatron_backend.MegatronBackend(
        job["config"], checkpoint=job.get("resume") if rank == 0 else None, group=group
    )
    if rank != 0:
        backend.follow()
        backend.close()
        return
    results = [backend.train_step(batch) for batch in job["batches"]]
    weights = {k: v.detach().cpu().clone() for k, v in backend.state_dict_for_publish().items()}
    if job.get("checkpoint"):
        backend.save_checkpoint(job["checkpoint"])
    backend.close()
    out.write_bytes(pickle.dumps({"weights": weights, "metrics": [r.metrics for r in results]}))


def model_parallel_run(
    spawn_ranks: Callable[..., None], job: dict[str, Any], tmp_path: Path, world: int = 2
) -> dict[str, Any]:
    out = tmp_path / "rank0.pkl"
    spawn_ranks(_model_parallel_rank, world, job, out)
    return pickle.loads(out.read_bytes())


def one_megatron_process(job: dict[str, Any]) -> dict[str, Any]:
    from tauflow.trainer.megatron.backend import MegatronBackend

    backend = MegatronBackend(job["config"], checkpoint=job.get("resume"))
    results = [backend.train_step(batch) for batch in job["batches"]]
    if job.get("checkpoint"):
        backend.save_checkpoint(job["checkpoint"])
    weights = {k: v.detach().cpu().clone() for k, v in backend.state_dict_for_publish().items()}
    return {"weights": weights, "metrics": [r.metrics for r in results]}


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tolerance: float = 5e-4) -> None:
    """The same weights, to the rounding AdamW amplifies: it divides each gradient by its own scale, so one near 0
    (a key bias's is 0 in exact arithmetic: attention ignores it), summed in another order, moves its weight by
    up to 1e-4 here (a few weights in a thousand); a wrong gradient moves weights by the learning rate, 1e-2."""
    assert a.keys() == b.keys()
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst <= tolerance, worst


STEP_OPTIONS = {"optim": OptimConfig(lr=1e-2, schedule="constant", grad_clip=0.5), "micro_batch_tokens": 24}
SAME_METRICS = ("loss", "grad_norm", "tokens", "entropy", "kl_ref")


def assert_like_one_process(
    spawn_ranks: Callable[..., None],
    model_dir: Path,
    batches: list[list[Group]],
    tmp_path: Path,
    world: int,
    parallel: dict[str, int],
    options: dict[str, Any],
    metrics: tuple[str, ...] = SAME_METRICS,
) -> None:
    """``batches`` on ``world`` ranks of the megatron backend with ``parallel`` (tensor_parallel, pipeline_parallel)
    make one process's updates: its ``metrics`` within 1e-4 relative, its weights."""
    single = one_megatron_process({"config": config(model_dir, kind="megatron", device="cpu", **options),
                                   "batches": batches})  # fmt: skip
    many = config(model_dir, kind="megatron", device="cpu", **parallel, **options)
    ranks = model_parallel_run(spawn_ranks, {"config": many, "batches": batches}, tmp_path, world=world)
    for mine, theirs in zip(ranks["metrics"], single["metrics"], strict=True):
        for key in metrics:
            assert mine[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), key
    assert_same_weights(ranks["weights"], single["weights"])


def test_tensor_parallel_ranks_make_the_updates_of_one_process_and_checkpoints_resume_at_either_size(
    spawn_ranks: Callable[..., None],
    megatron_on_cpu: None,
    tiny_model_dir: Path,
    make_groups: MakeGroups,
    tmp_path: Path,
) -> None:
    # TP = 2 (every rank the whole batch and half of each attention and MLP block, of the embedding and the
    # output layer) makes the updates TP = 1 makes: the same losses, the same gradient norm (clipped: the
    # shards' norms summed over the ranks, the norms' scales once), the same weights gathered for a publish.
    # Its checkpoint (the shards merged: HF weights, AdamW moments as one process keys them) resumes in one
    # process, and one process's checkpoint resumes on two ranks (the moments cut again).
    first, second = [make_groups(1, 4), make_groups(2, 3, prefix="h")], [make_groups(3, 4, prefix="k")]
    # (with a KL to the reference: its forward, a Hugging Face model's, runs on every rank too)
    opts = {"optim": OptimConfig(lr=1e-2, schedule="constant", grad_clip=0.5), "algorithm_options": {"kl_coef": 0.05}}
    one = config(tiny_model_dir, kind="megatron", device="cpu", **opts)
    two = config(tiny_model_dir, kind="megatron", device="cpu", tensor_parallel=2, **opts)
    straight = one_megatron_process({"config": one, "batches": first + second})
    parallel = model_parallel_run(
        spawn_ranks, {"config": two, "batches": first, "checkpoint": tmp_path / "two"}, tmp_path
    )
    before = one_megatron_process({"config": one, "batches": []})["weights"]
    assert any(not torch.equal(before[k], parallel["weights"][k]) for k in before)  # the steps changed weights
    for mine, theirs in zip(parallel["metrics"], straight["metrics"], strict=False):
        for key in ("loss", "grad_norm", "tokens", "entropy", "kl_ref"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), key
    assert straight["metrics"][0]["grad_norm"] > 0.5  # (so the clip acted)
    halfway = one_megatron_process({"config": one, "batches": first})
    assert_same_weights(parallel["weights"], halfway["weights"])

    resumed = one_megatron_process({"config": one, "batches": second, "resume": tmp_path / "two"})
    assert_same_weights(resumed["weights"], straight["weights"])  # the moments came back merged
    one_megatron_process({"config": one, "batches": first, "checkpoint": tmp_path / "one"})
    again = model_parallel_run(spawn_ranks, {"config": two, "batches": second, "resume": tmp_path / "one"}, tmp_path)
    assert_same_weights(again["weights"], straight["weights"])  # ... and cut again


def test_data_parallel_replicas_of_tensor_parallel_ranks_make_the_updates_of_one_process(
    spawn_ranks: Callable[..., None],
    megatron_on_cpu: None,
    tiny_model_dir: Path,
    make_groups: MakeGroups,
    tmp_path: Path,
) -> None:
    # Four ranks: two data-parallel replicas of two tensor-parallel ranks each. A replica's ranks take the same
    # share of the batch; the replicas' gradients are averaged; the metrics count each replica once. (With a KL
    # to the reference, a Hugging Face model sharded over all four ranks while the replicas see other samples.)
    batches = [make_groups(1, 6), make_groups(2, 5, prefix="h")]
    options = {**STEP_OPTIONS, "algorithm_options": {"kl_coef": 0.05}}
    assert_like_one_process(spawn_ranks, tiny_model_dir, batches, tmp_path, 4, {"tensor_parallel": 2}, options)


# -- pipeline parallelism: stages of a two-layer model, alone and beside the other kinds ---------------------------


@pytest.fixture(scope="module")
def layered_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny Qwen2s to split into stages: "tied" (two layers, the output layer the embedding, as Qwen2-0.5B's),
    "untied" (two layers, its own output layer), "deep" (four layers, tied)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = {}
    for name, layers in (("tied", 2), ("untied", 2), ("deep", 4)):
        torch.manual_seed(1)
        model = Qwen2ForCausalLM(
            Qwen2Config(vocab_size=16, hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
                        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
                        tie_word_embeddings=name != "untied")
        )  # fmt: skip
        out[name] = tmp_path_factory.mktemp(f"qwen2-{name}")
        model.save_pretrained(out[name])
    return out


def test_pipeline_stages_make_the_updates_of_one_process_and_checkpoints_resume_at_either_size(
    spawn_ranks: Callable[..., None],
    megatron_on_cpu: None,
    layered_model_dirs: dict[str, Path],
    make_groups: MakeGroups,
    tmp_path: Path,
) -> None:
    # PP = 2: the first stage holds the embedding and layer 0, the last layer 1, the norm and the output layer
    # (tied: a copy of the embedding, its gradient summed with the first stage's). The stages take turns on each
    # micro-batch (hidden states forward, their gradient back) and make the updates one process makes: the same
    # losses and entropy (the last stage's log-probs, broadcast), the same clipped gradient norm (summed over the
    # stages, the tied copy once), the same weights. A checkpoint (the stages gathered: the whole model in one
    # process's names) resumes in one process, and one process's on two stages. The second batch trains nothing
    # (equal rewards: no advantage): an update without gradients, which must leave the tied copies alone.
    no_advantage = make_groups(0, 2, prefix="z")
    for group in no_advantage:
        for sample in group.samples:
            sample.reward = 1.0
    first = [make_groups(1, 4), no_advantage, make_groups(2, 3, prefix="h")]
    second = [make_groups(3, 4, prefix="k")]
    opts = {"optim": OptimConfig(lr=1e-2, schedule="constant", grad_clip=0.5), "micro_batch_tokens": 24,
            "algorithm_options": {"kl_coef": 0.05}}  # fmt: skip
    model_dir = layered_model_dirs["tied"]
    one = config(model_dir, kind="megatron", device="cpu", **opts)
    two = config(model_dir, kind="megatron", device="cpu", pipeline_parallel=2, **opts)
    straight = one_megatron_process({"config": one, "batches": first + second})
    stages = model_parallel_run(
        spawn_ranks, {"config": two, "batches": first, "checkpoint": tmp_path / "two"}, tmp_path
    )
    before = one_megatron_process({"config": one, "batches": []})["weights"]
    assert all(not torch.equal(before[k], stages["weights"][k]) for k in before if "norm" not in k)  # every stage's
    for mine, theirs in zip(stages["metrics"], straight["metrics"], strict=False):
        for key in ("loss", "grad_norm", "tokens", "entropy", "kl_ref", "micro_batches"):
            assert mine.get(key, 0.0) == pytest.approx(theirs.get(key, 0.0), rel=1e-4, abs=1e-6), key
    assert straight["metrics"][0]["grad_norm"] > 0.5 and straight["metrics"][0]["micro_batches"] > 1
    halfway = one_megatron_process({"config": one, "batches": first})
    assert_same_weights(stages["weights"], halfway["weights"])

    resumed = one_megatron_process({"config": one, "batches": second, "resume": tmp_path / "two"})
    assert_same_weights(resumed["weights"], straight["weights"])  # the moments came back whole
    one_megatron_process({"config": one, "batches": first, "checkpoint": tmp_path / "one"})
    again = model_parallel_run(spawn_ranks, {"config": two, "batches": second, "resume": tmp_path / "one"}, tmp_path)
    assert_same_weights(again["weights"], straight["weights"])  # ... and went to their stages again


@pytest.mark.parametrize(
    ("tp", "pp", "model", "in_flight", "chunk"),
    [(1, 2, "untied", 0, 0), (2, 2, "tied", 1, 5), (1, 4, "deep", 3, 7)],
    ids=["dp2-pp2", "tp2-pp2-turns-chunks", "pp4-window3-chunks"],
)
def test_four_ranks_with_pipeline_stages_make_the_updates_of_one_process(
    spawn_ranks: Callable[..., None],
    megatron_on_cpu: None,
    layered_model_dirs: dict[str, Path],
    make_groups: MakeGroups,
    tmp_path: Path,
    tp: int,
    pp: int,
    model: str,
    in_flight: int,
    chunk: int,
) -> None:
    # Two stages beside two data-parallel replicas (megatron's rank order: ranks 0 and 1 are the first stage of
    # replicas 0 and 1; a replica's stages see the same samples), or beside two tensor-parallel ranks (each stage
    # split in two, its shards gathered for the publish, the tied embedding's vocabulary shards summed stage to
    # stage), or four stages (two in the middle, receiving and sending): the updates one process makes, the
    # metrics counted once per replica. The micro-batches in flight: as many as the stages (the default), one
    # (the stages take turns), three (windows of three, the last shorter). Four stages make two updates a step:
    # π_prox from the pipeline's forward without gradients before the first (a mini-batch as one window).
    # The last two compute the logits in chunks on the ranks (backend.logits_chunk_tokens; with TP = 2 each
    # chunk's vocabulary-parallel sums, the tied output weight the last stage's copy), the one process whole.
    batches = [make_groups(1, 6), make_groups(2, 5, prefix="h")]
    options = {**STEP_OPTIONS, "algorithm_options": {"kl_coef": 0.05, **({"mini_batches": 2} if pp == 4 else {})}}
    parallel = {"tensor_parallel": tp, "pipeline_parallel": pp, "pipeline_micro_batches_in_flight": in_flight,
                "logits_chunk_tokens": chunk}  # fmt: skip
    assert_like_one_process(spawn_ranks, layered_model_dirs[model], batches, tmp_path, 4, parallel, options)


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_ppo_with_a_critic_beside_model_parallel_ranks_makes_the_updates_of_one_process(
    spawn_ranks: Callable[..., None],
    megatron_on_cpu: None,
    layered_model_dirs: dict[str, Path],
    make_groups: MakeGroups,
    tmp_path: Path,
    tp: int,
    pp: int,
) -> None:
    # PPO's critic is a Hugging Face model, data parallel over every rank (FSDP2): the ranks that split the
    # policy see the same samples, so the critic's gradients, averaged over all of them and scaled by the
    # replicas, are one process's. The values before the step (GAE), the value loss and both updates match.
    batches = [make_groups(1, 4), make_groups(2, 3, prefix="h")]
    parallel = {"tensor_parallel": tp, "pipeline_parallel": pp}
    metrics = ("loss", "grad_norm", "value_loss", "critic_grad_norm", "value_mean", "return_mean")
    options = {**STEP_OPTIONS, "algorithm": "ppo"}
    assert_like_one_process(spawn_ranks, layered_model_dirs["tied"], batches, tmp_path, 2, parallel, options, metrics)
