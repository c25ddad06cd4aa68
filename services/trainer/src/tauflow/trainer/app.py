"""Entry point of the trainer service.

The service layer (config, gRPC TrainerService, the queue → step → ack → publish loop) is not built yet;
the domain core it will drive is in `tauflow.trainer.backend` (TorchBackend), `tauflow.trainer.algorithms`
and `tauflow.trainer.batch`.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    raise SystemExit(
        "tauflow-trainer: the service layer is not built yet; only the torch backend's domain core "
        "(tauflow.trainer.backend.TorchBackend) is available, as a library"
    )
