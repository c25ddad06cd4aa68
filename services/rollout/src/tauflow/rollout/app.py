"""Entry point of the rollout service. Only the generation engines exist so far (tauflow.rollout.engine);
the gRPC service layer and the rollout loop are not built yet, so the command says so and exits 2."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    del argv
    print(
        "tauflow-rollout: the service layer is not built yet; only the generation engines exist "
        "(tauflow.rollout.engine: the `hf` engine).",
        file=sys.stderr,
    )
    return 2
