"""The service's process: its log holds what it says, not the progress bars of the libraries it uses."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from tauflow.trainer.app import quiet_progress_bars
from tauflow.trainer.backend import TorchBackend, TorchBackendConfig


@pytest.fixture
def quiet() -> Iterator[None]:
    from huggingface_hub.utils import enable_progress_bars
    from transformers.utils import logging as transformers_logging

    quiet_progress_bars()
    yield
    transformers_logging.enable_progress_bar()  # as the other tests found them
    enable_progress_bars()


def test_loading_and_checkpointing_draw_no_progress_bars(
    tiny_model_dir: Path,
    tmp_path: Path,
    quiet: None,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # (the process's log handlers as a service has none: one an earlier test left, on a stream since closed,
    # printed "--- Logging error ---" for the resume's log line)
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    capfd.readouterr()
    backend = TorchBackend(TorchBackendConfig(model_path=str(tiny_model_dir)))  # "Loading weights" unquieted
    backend.save_checkpoint(tmp_path / "ckpt")  # "Writing model shards" unquieted
    TorchBackend(TorchBackendConfig(model_path=str(tiny_model_dir)), checkpoint=tmp_path / "ckpt")
    out, err = capfd.readouterr()
    assert (out, err) == ("", "")
