"""Data parallelism: N ranks make the update one rank makes on the same groups (FSDP2 and DDP, gloo on
loopback), checkpoints gathered on rank 0 resume at any world size, and the token-balanced split."""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tauflow.trainer.backend import TorchBackend, TorchBackendConfig
from tauflow.trainer.batch import Group, Sample
from tauflow.trainer.optim import OptimConfig
from tauflow.trainer.parallel import DistributedConfig, RankGroup, balance_by_tokens, rank_device

MakeGroups = Callable[..., list[Group]]
TOLERANCE = 1e-5  # the bound on the parameters after a step, world size 2 against 1


def backend_config(model_dir: Path, **kw: Any) -> TorchBackendConfig:
    kw.setdefault("optim", OptimConfig(lr=1e-2, weight_decay=0.01))
    # Small micro-batches, so that the ranks run several and unequal numbers of them.
    return TorchBackendConfig(model_path=str(model_dir), micro_batch_tokens=24, **kw)


def _rank(rank: int, world: int, port: int, strategy: str, job: dict[str, Any], out: Path) -> None:
    """One rank: the steps of ``job`` (rank 0 leads, the others follow); rank 0 writes what it saw."""
    torch.set_num_threads(1)
    dist = DistributedConfig(world, rank, f"127.0.0.1:{port}", strategy=strategy, timeout_s=120, keepalive_s=60)
    group = RankGroup(dist, torch.device(job.get("device", "cpu")))  # (cuda: NCCL, the backend's auto choice)
    # Only rank 0 is told where the checkpoint is, as on Kubernetes, where only its pod has the volume.
    backend = TorchBackend(job["config"], checkpoint=job.get("resume") if rank == 0 else None, group=group)
    if rank == job.get("failing_release", (None,))[0]:  # this rank's n-th offload fails (no pinned memory left)
        from tauflow.models.offload import ParameterOffload

        to_host, calls = ParameterOffload.to_host, [0]

        def failing(self: ParameterOffload) -> int:
            calls[0] += 1
            if calls[0] == job["failing_release"][1]:
                raise RuntimeError("no pinned host memory left (injected)")
            return to_host(self)

        ParameterOffload.to_host = failing  # type: ignore[method-assign]  # (in this rank's process only)
    if rank != 0:
        backend.follow()
        backend.close()
        return
    results, released = [], []
    for batch in job["batches"]:
        results.append(backend.train_step(batch))
        if job.get("release"):  # colocated mode's turn: every rank's weights and moments in host memory
            try:
                released.append((backend.release_memory(), offloaded_state(backend)))
            except RuntimeError as e:
                released.append((str(e), {}))
    weights = {k: v.detach().cpu().clone() for k, v in backend.state_dict_for_publish().items()}
    if job.get("checkpoint"):
        if job.get("release"):
            backend.release_memory()  # (a checkpoint asked for while offloaded)
        backend.save_checkpoint(job["checkpoint"])
    backend.close()
    out.write_bytes(pickle.dumps({"weights": weights, "metrics": [r.metrics for r in results], "released": released}))


def offloaded_state(backend: TorchBackend) -> dict[str, Any]:
    """Whether this rank's weights and AdamW moments are out of device memory now (a DTensor's storage
    emptied, a plain parameter's data empty, a plain moment replaced by its host buffer), and their bytes."""
    from tauflow.models.offload import sharded_local

    def emptied(t: torch.Tensor) -> bool:
        local = sharded_local(t)
        return t.numel() == 0 if local is None else local.untyped_storage().nbytes() == 0

    offload = backend._offload
    assert offload is not None
    params = list(backend.model.parameters())
    models = [m for m in (backend.model, backend.ref_model) if m is not None]
    weights = [p for m in models for p in m.parameters()]
    moments = [(p, key) for p in params if backend.optimizer.state.get(p) for key in ("exp_avg", "exp_avg_sq")]
    return {
        "weights_out": all(emptied(p.data) for p in weights),
        # FSDP2: what went out is the shards (a root left gathered by a forward without backward resharded first)
        "sharded": sorted({type(p.data).__name__ for p in weights}),
        "moments_out": all(
            emptied(backend.optimizer.state[p][key]) or backend.optimizer.state[p][key] is offload._host[(id(p), key)]
            for p, key in moments
        ),
        "moment_bytes": offload.offloaded_bytes,
    }


def run_ranks(
    spawn_ranks: Callable[..., None],
    world: int,
    strategy: str,
    job: dict[str, Any],
    tmp_path: Path,
    timeout_s: float = 180,
) -> dict[str, Any]:
    """``job`` on ``world`` ranks, each its own process (gloo on loopback); rank 0's weights and metrics."""
    out = tmp_path / f"rank0-{strategy}-{world}.pkl"
    spawn_ranks(_rank, world, strategy, job, out, timeout_s=timeout_s)
    return pickle.loads(out.read_bytes())


def one_process(job: dict[str, Any]) -> dict[str, Any]:
    backend = TorchBackend(job["config"], checkpoint=job.get("resume"))
    results = [backend.train_step(batch) for batch in job["batches"]]
    if job.get("checkpoint"):
        backend.save_checkpoint(job["checkpoint"])
    weights = {k: v.detach().cpu().clone() for k, v in backend.state_dict_for_publish().items()}
    return {"weights": weights, "metrics": [r.metrics for r in results]}


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tolerance: float = TOLERANCE) -> float:
    assert a.keys() == b.keys()
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst <= tolerance, worst
    return worst


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_two_ranks_make_the_update_of_one(
    spawn_ranks: Callable[..., None], strategy: str, tiny_model_dir: Path, make_groups: MakeGroups, tmp_path: Path
) -> None:
    # Two steps: the second one's Adam update depends on the first's moments, so they must agree too.
    batches = [make_groups(1, 6), make_groups(2, 5, prefix="h")]
    job = {"config": backend_config(tiny_model_dir), "batches": batches}
    single = one_process(job)
    both = run_ranks(spawn_ranks, 2, strategy, job, tmp_path)
    before = TorchBackend(job["config"]).state_dict_for_publish()
    assert any(not torch.equal(before[k], single["weights"][k]) for k in before)  # the steps did change weights
    assert_same_weights(both["weights"], single["weights"])
    for mine, theirs in zip(both["metrics"], single["metrics"], strict=True):
        for key in ("loss", "grad_norm", "tokens", "clip_fraction", "is_weight_mean", "entropy"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-7), key


@pytest.mark.gpu
@pytest.mark.parametrize("offload", [False, True], ids=["resident", "offloading"])
@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_a_cuda_rank_over_nccl_makes_the_update_of_the_plain_backend(
    spawn_ranks: Callable[..., None],
    strategy: str,
    offload: bool,
    tiny_model_dir: Path,
    make_groups: MakeGroups,
    tmp_path: Path,
) -> None:
    """FSDP2 and DDP on CUDA with NCCL (one rank: NCCL refuses two ranks on one GPU), against one process;
    offloading: the weights and moments leave the GPU between steps (FSDP2's shards emptied in place)."""
    batches = [make_groups(1, 6), make_groups(2, 5, prefix="h")]
    plain = backend_config(tiny_model_dir, device="cuda")
    config = backend_config(tiny_model_dir, device="cuda", offload_model=offload, offload_optimizer=offload)
    job = {"config": config, "batches": batches, "device": "cuda", "release": offload}
    # (within the GPU check's 90 s a test: the fixture's own message, not pytest-timeout's, says what failed)
    ranked = run_ranks(spawn_ranks, 1, strategy, job, tmp_path, timeout_s=80)
    assert_same_weights(ranked["weights"], one_process({**job, "config": plain})["weights"])
    assert len(ranked["released"]) == (len(batches) if offload else 0)
    assert all(state["weights_out"] and state["moments_out"] for _, state in ranked["released"])


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_two_ranks_make_the_updates_of_one_over_mini_batches_and_epochs(
    spawn_ranks: Callable[..., None], strategy: str, tiny_model_dir: Path, make_groups: MakeGroups, tmp_path: Path
) -> None:
    # 2 mini-batches x 2 epochs: four updates a step, each normalised over its whole mini-batch (both ranks'
    # shares), the proximal log-probs computed before the first; rank 0's clip statistics cover every rank.
    # With the forward before the advantages spread over the ranks too: the KL in the reward and rejection.
    options = {
        "mini_batches": 2,
        "epochs": 2,
        "clip_ratio_c": 2.0,
        "entropy_coef": 0.01,
        "kl_reward_coef": 0.1,
        "reject_upper": 1.5,
    }
    job = {"config": backend_config(tiny_model_dir, algorithm_options=options), "batches": [make_groups(9, 6)]}
    single = one_process(job)
    # the ranks compute the logits in chunks (backend.logits_chunk_tokens), checkpointed inside FSDP2's root
    chunked = dataclasses.replace(job["config"], logits_chunk_tokens=5)
    both = run_ranks(spawn_ranks, 2, strategy, {**job, "config": chunked}, tmp_path)
    # Four Adam updates at lr 1e-2 amplify the ranks' float32 reduction order (~1e-7) more than one update
    # does: 1.3e-5 here (and 1e-5 without the rejection): 5e-5 for this step, the 1e-5 for a step of
    # one update (above).
    assert_same_weights(both["weights"], single["weights"], tolerance=5 * TOLERANCE)
    for key in (
        "loss",
        "grad_norm",
        "tokens",
        "clip_fraction",
        "clip_fraction_dual",
        "ppo_kl",
        "updates",
        "rejected_samples",
    ):
        assert both["metrics"][0][key] == pytest.approx(single["metrics"][0][key], rel=1e-5, abs=1e-7), key
    assert single["metrics"][0]["clip_fraction"] > 0 and single["metrics"][0]["rejected_samples"] > 0


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_two_ranks_train_the_policy_and_the_critic_as_one(
    spawn_ranks: Callable[..., None], strategy: str, tiny_model_dir: Path, make_groups: MakeGroups, tmp_path: Path
) -> None:
    # PPO with GAE: the critic's values before the advantages come from the forward spread over the ranks,
    # its value loss is normalised over every rank's share, and its gradients are reduced as the policy's.
    # The second step's advantages come from the critic the first step trained: equal metrics there mean
    # equal critics.
    config = backend_config(
        tiny_model_dir, algorithm="ppo", algorithm_options={"mini_batches": 2}, critic_optim=OptimConfig(lr=1e-2)
    )
    job = {"config": config, "batches": [make_groups(5, 6), make_groups(6, 5, prefix="v")]}
    single = one_process(job)
    both = run_ranks(spawn_ranks, 2, strategy, job, tmp_path)
    assert_same_weights(both["weights"], single["weights"], tolerance=5 * TOLERANCE)
    for mine, theirs in zip(both["metrics"], single["metrics"], strict=True):
        for key in ("loss", "value_loss", "critic_grad_norm", "value_mean", "return_mean", "advantage_mean"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), key


def test_a_rank_without_samples_still_takes_the_step(
    spawn_ranks: Callable[..., None], tiny_model_dir: Path, tmp_path: Path
) -> None:
    # One sample trains: rank 1 has nothing, yet runs FSDP2's collectives with an empty micro-batch.
    one = Group("solo", [Sample([1, 2], [3, 4, 5], [-2.0] * 3, reward=float(i)) for i in range(2)])
    one.samples[0].loss_mask = [False, False, False]
    job = {"config": backend_config(tiny_model_dir), "batches": [[one]]}
    assert_same_weights(run_ranks(spawn_ranks, 2, "fsdp", job, tmp_path)["weights"], one_process(job)["weights"])


def test_a_checkpoint_of_two_ranks_resumes_in_one_process(
    spawn_ranks: Callable[..., None], tiny_model_dir: Path, make_groups: MakeGroups, tmp_path: Path
) -> None:
    first, second = make_groups(3, 4), make_groups(4, 4, prefix="k")
    config = backend_config(tiny_model_dir)
    run_ranks(spawn_ranks, 2, "fsdp", {"config": config, "batches": [first], "checkpoint": tmp_path / "two"}, tmp_path)
    resumed = one_process({"config": config, "batches": [second], "resume": tmp_path / "two"})
    straight = one_process({"config": config, "batches": [first, second]})
    assert_same_weights(resumed["weights"], straight["weights"])  # optimizer moments and schedule came back
    # ... and a one-process checkpoint resumes on two ranks.
    one_process({"config": config, "batches": [first], "checkpoint": tmp_path / "one"})
    for strategy in ("fsdp", "ddp"):  # rank 1 reads nothing from disk: rank 0 shares weights and state
        two = run_ranks(
            spawn_ranks, 2, strategy, {"config": config, "batches": [second], "resume": tmp_path / "one"}, tmp_path
        )
        assert_same_weights(two["weights"], straight["weights"])


def test_balance_by_tokens_splits_evenly_and_alike() -> None:
    lengths = [9, 3, 7, 7, 2, 8, 1, 5]
    shares = balance_by_tokens(lengths, 3)
    assert sorted(i for share in shares for i in share) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in share) for share in shares]
    assert max(loads) - min(loads) <= max(lengths)
    assert loads == [14, 14, 14]  # 45 tokens, three ranks
    assert balance_by_tokens(lengths, 3) == shares  # the same on every rank
    assert balance_by_tokens([4], 2) == [[0], []]
    assert balance_by_tokens([], 2) == [[], []]


def test_distributed_config_refuses_what_cannot_work() -> None:
    with pytest.raises(ValueError, match="rank"):
        DistributedConfig(world_size=2, rank=2)
    with pytest.raises(ValueError, match="strategy"):
        DistributedConfig(strategy="zero3")
    with pytest.raises(ValueError, match="master_address"):
        DistributedConfig(master_address="nohost")


def test_a_rank_given_cuda_without_an_index_takes_its_own_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch.cuda.set_device(torch.device("cuda")) raises: every multi-rank trainer on "cuda" failed to start
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert rank_device(DistributedConfig(world_size=4, rank=3), torch.device("cuda")) == torch.device("cuda", 3)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert rank_device(DistributedConfig(world_size=4, rank=3), torch.device("cuda")) == torch.device("cuda", 1)
    config = DistributedConfig(world_size=4, rank=3, local_rank=2)
    assert rank_device(config, torch.device("cuda")) == torch.device("cuda", 2)
    assert rank_device(config, torch.device("cuda", 0)) == torch.device("cuda", 0)  # (an index given stays)
    assert rank_device(config, torch.device("cpu")) == torch.device("cpu")


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_two_ranks_offloading_between_steps_make_the_updates_of_one_and_checkpoint_them(
    spawn_ranks: Callable[..., None], strategy: str, tiny_model_dir: Path, make_groups: MakeGroups, tmp_path: Path
) -> None:
    # Colocated mode on a node of several GPUs: while rank 0 waits for its batch, every rank's weights (the
    # policy's and the KL reference's) and AdamW moments (FSDP2: its shards, emptied in place; DDP: its
    # replica) wait in host memory; the next command brings the weights back on every rank, the next update
    # the moments. The run is the same run, and a checkpoint asked for while offloaded gathers the real state.
    # The first batch trains nothing (equal rewards: no advantage), so the policy, as the reference always,
    # ran a forward without backward: FSDP2 leaves its root gathered then.
    no_advantage = make_groups(0, 2, prefix="z")
    for group in no_advantage:
        for sample in group.samples:
            sample.reward = 1.0
    batches = [no_advantage, make_groups(1, 6), make_groups(2, 5, prefix="h")]
    # (the KL in the reward, not in the loss: a KL term in the loss would train the equal-reward groups too)
    kl = {"algorithm_options": {"kl_reward_coef": 0.05}}
    plain = backend_config(tiny_model_dir, **kl)
    offloading = backend_config(tiny_model_dir, offload_model=True, offload_optimizer=True, **kl)
    single = one_process({"config": plain, "batches": batches})
    # rank 1 fails its second release: rank 0 says so, and the ranks go on in step
    job = {"config": offloading, "batches": batches, "release": True, "checkpoint": tmp_path / "ck",
           "failing_release": (1, 2)}  # fmt: skip
    both = run_ranks(spawn_ranks, 2, strategy, job, tmp_path)
    assert_same_weights(both["weights"], single["weights"])
    full = sum(t.numel() * t.element_size() for t in single["weights"].values() if t.is_floating_point())
    assert both["metrics"][0]["skipped_zero_advantage_groups"] == 2
    failed = both["released"].pop(1)
    assert (
        failed[0]
        == "could not offload every rank's weights (rank 1: RuntimeError: no pinned host memory left (injected))"
    )
    for step, (moved, state) in zip((0, 2), both["released"], strict=True):
        assert state["weights_out"] and state["moments_out"]
        assert state["sharded"] == (["DTensor"] if strategy == "fsdp" else ["Tensor"])
        # (AdamW's moments exist from the first step on: its zero-advantage update is a zero gradient's, and
        # still an update)
        if strategy == "ddp":  # every rank a whole replica of the policy and of the reference
            assert moved == 2 * 2 * full
            assert state["moment_bytes"] == 2 * full
        else:  # a shard each (FSDP2 pads a shard to an even split): about half on rank 0
            assert 2 * full <= moved <= 2 * full * 1.1
            assert full * 0.9 <= state["moment_bytes"] <= full * 1.1  # two moments of half the weights
    resumed = one_process({"config": plain, "batches": [make_groups(3, 4)], "resume": tmp_path / "ck"})
    straight = one_process({"config": plain, "batches": [*batches, make_groups(3, 4)]})
    # the moments were gathered, not the emptied ones (three Adam updates, two of them on two ranks, amplify the
    # ranks' float32 reduction order more than one does (see the mini-batch test above): 1.1e-5 on one CPU,
    # below 1e-5 on another; emptied moments would move weights by the lr, 1e-2)
    assert_same_weights(resumed["weights"], straight["weights"], tolerance=2 * TOLERANCE)
