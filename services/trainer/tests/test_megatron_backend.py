"""The megatron backend: megatron-core's GPTModel built from a Hugging Face folder holds its weights (published
and saved in Hugging Face names, loadable by from_pretrained); TP = PP = 1 gives the torch backend's loss on
the same batch over three steps and checkpoints resume: on a GPU (marked gpu), and on the CPU under the
conftest's shim (megatron-core's hard-coded CUDA device pointed at the CPU; float32 only)."""

from __future__ import annotations

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
    with pytest.raises(ValueError, match="TP = PP = 1 for now"):
        init_megatron(torch.device("cpu"), tensor_parallel=2)
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
    for name, t in torch_backend.state_dict_for_publish().items():
        assert torch.allclose(published[name].float(), t.float(), atol=50 * tolerance), name


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
