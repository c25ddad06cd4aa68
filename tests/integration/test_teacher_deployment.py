"""On-policy distillation with the teacher as its own deployment: a real rollout server hosts the teacher
(no data set, no weight sidecar: its weights never change) and answers ComputeLogprobs; the trainer asks it
for the log-probs of the student's sampled tokens. The step is the one an in-process teacher makes."""

from __future__ import annotations

import asyncio
import random
import sys
from pathlib import Path

import pytest
import torch

from tauflow.core.config import ChannelConfig
from tauflow.trainer.adapters.rollout_client import RolloutTeacher
from tauflow.trainer.backend import TorchBackend, TorchBackendConfig
from tauflow.trainer.batch import Group, Sample
from tauflow.trainer.optim import OptimConfig
from tests.runs import ADDITION


def models(tmp_path: Path) -> tuple[Path, Path]:
    """A student and a teacher of the embedded task, two random models of the same tokenizer."""
    sys.path.insert(0, str(ADDITION))
    import task

    student, teacher = tmp_path / "student", tmp_path / "teacher"
    task.build_model(student, hidden=32, layers=1, heads=2, seed=0)
    task.build_model(teacher, hidden=48, layers=2, heads=2, seed=1)  # larger, another initialisation
    for folder in (student, teacher):
        task.build_tokenizer(folder)
    return student, teacher


def groups(seed: int) -> list[Group]:
    rng = random.Random(seed)
    out = []
    for g in range(4):
        prompt = [1, *(rng.randrange(3, 13) for _ in range(4))]
        samples = []
        for i in range(4):
            c = rng.randint(1, 4)
            samples.append(Sample(prompt, [rng.randrange(3, 15) for _ in range(c)], [-2.5] * c, sample_id=str(i)))
        out.append(Group(f"g{seed}-{g}", samples))
    return out


def test_a_teacher_served_by_a_rollout_server_trains_as_one_in_the_trainer(service_process, tmp_path: Path) -> None:
    student, teacher = models(tmp_path)
    server = service_process("rollout", {"model_path": str(teacher), "server_id": "teacher"})

    def backend(**teacher_kw: object) -> TorchBackendConfig:
        return TorchBackendConfig(
            model_path=str(student), algorithm="opd", optim=OptimConfig(lr=1e-2), temperature=0.8, **teacher_kw
        )

    local = TorchBackend(backend(teacher_model_path=str(teacher)))
    expected = [local.train_step(groups(k)) for k in range(2)]

    async def remote_steps() -> tuple[list[object], dict[str, torch.Tensor]]:
        client = RolloutTeacher(server.address, ChannelConfig(), asyncio.get_running_loop())
        try:
            remote = TorchBackend(backend(teacher_address=server.address), teacher=client)
            results = [await asyncio.to_thread(remote.train_step, groups(k)) for k in range(2)]
            return results, remote.state_dict_for_publish()
        finally:
            await client.close()

    results, weights = asyncio.run(remote_steps())
    for got, want in zip(results, expected, strict=True):
        assert got.metrics["kl_teacher"] == pytest.approx(want.metrics["kl_teacher"], abs=1e-5)
        assert abs(got.metrics["kl_teacher"]) > 1e-3  # two random models: near-uniform, yet not the same
    mine = local.state_dict_for_publish()
    worst = max(float((weights[k] - mine[k]).abs().max()) for k in mine)
    assert worst < 1e-5, worst
    assert "Traceback" not in server.log_text()


def test_the_teacher_is_one_of_a_folder_and_a_server_and_the_full_kl_needs_the_folder(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="one teacher"):
        TorchBackendConfig(model_path="m", algorithm="opd", teacher_model_path="t", teacher_address="h:1")
    with pytest.raises(ValueError, match="teacher_model_path or teacher_address"):
        TorchBackendConfig(model_path="m", algorithm="opd")
    with pytest.raises(ValueError, match="whole distributions"):
        TorchBackendConfig(
            model_path="m", algorithm="opd", algorithm_options={"opd_loss": "reverse_kl"}, teacher_address="h:1"
        )
