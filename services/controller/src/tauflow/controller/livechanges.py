"""The live changes of a run, kept in ``<out_dir>/live.json`` so that ``tauflow run --resume`` after the
controller's death goes on with them, not with the config's values.

``tauflow set max-staleness`` and ``tauflow scale rollout`` change a run while it trains; the controller
holds the τ in force and the rollout target in memory. A controller that died (SIGKILL, OOM, a lost node)
and was resumed read them from the config again: a run dialled from τ = 0 to τ = 4 came back at τ = 0, a
run scaled to four replicas came back with one. So each change (and a target that fell back) is written
here, replacing the file whole, with the config's values it was made against.

On ``--resume`` a key whose config value is still the one recorded takes the live value; a key whose
config value differs was changed for the resume by its user (``--set max_staleness=8``), and the config
wins. A new run (no ``--resume``) removes the file: its changes are its own. A file that cannot be read or
is damaged is logged and ignored (the config's values, as before the file existed); one that cannot be
written is logged and the run goes on (the change is in force; only a resume after a crash would lose it).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tauflow.controller.config import MAX_ROLLOUT_REPLICAS, RunConfig
from tauflow.controller.launcher import describe_os_error, read_json_file, replace_file
from tauflow.core.staleness import check_tau

log = logging.getLogger(__name__)

LIVE_FILE = "live.json"
_FORMAT = 1
MAX_LIVE_FILE_BYTES = 64 * 1024  # (a few numbers: anything larger is not ours)


@dataclass(frozen=True)
class LiveValues:
    """What a live change sets: the τ in force and the rollout replicas' target."""

    max_staleness: int
    rollout_replicas: int

    @classmethod
    def of(cls, config: RunConfig) -> LiveValues:
        return cls(config.max_staleness, config.rollout.replicas)


def write_live(out_dir: Path, configured: LiveValues, live: LiveValues) -> None:
    """Records ``live`` against the config's values (replacing the file whole); raises OSError."""
    text = json.dumps({"format": _FORMAT, "config": asdict(configured), "live": asdict(live)}, indent=1)
    replace_file(out_dir / LIVE_FILE, text.encode(), durable=True)


def forget_live(out_dir: Path) -> None:
    """A new run: a previous run's live changes are not its own. They are kept one generation back
    (``live.json.prev``), as its checkpoints and queue log are, so that a rerun by mistake loses nothing."""
    path = out_dir / LIVE_FILE
    try:
        path.replace(path.with_name(LIVE_FILE + ".prev"))
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("could not set a previous run's live changes aside", extra={"error": describe_os_error(e)})


def read_live(out_dir: Path) -> tuple[LiveValues, LiveValues] | None:
    """(the config's values, the live ones) as last recorded, or None: no file, or one that is damaged (logged)."""
    path = out_dir / LIVE_FILE
    try:
        doc = read_json_file(path, MAX_LIVE_FILE_BYTES)
        if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
            raise ValueError("not a live-changes record of this version")
        return _values(doc.get("config")), _values(doc.get("live"))
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning(
            "could not read the run's live changes; the config's values are used", extra={"error": describe_os_error(e)}
        )
        return None
    except (ValueError, TypeError) as e:
        log.warning(
            "the run's live changes are damaged; the config's values are used",
            extra={"file": str(path), "error": str(e)[:200]},
        )
        return None


def _values(part: Any) -> LiveValues:
    if not isinstance(part, Mapping):
        raise TypeError("config and live must be objects")
    tau: Any = part.get("max_staleness")
    replicas: Any = part.get("rollout_replicas")
    check_tau(tau)  # (TypeError for anything but an integer)
    if isinstance(replicas, bool) or not isinstance(replicas, int) or not 1 <= replicas <= MAX_ROLLOUT_REPLICAS:
        raise ValueError(f"rollout_replicas={replicas!r} is not between 1 and {MAX_ROLLOUT_REPLICAS}")
    return LiveValues(tau, replicas)


def resumed_config(config: RunConfig) -> tuple[RunConfig, dict[str, int]]:
    """The config a ``--resume`` runs with: each live value whose config value is the one it was made against
    (:func:`read_live`); returns it and the keys taken from the live changes. Without ``resume``, the config
    as it is. Reads only: :func:`settle_live` records, once the run holds its out_dir."""
    if not config.resume:
        return config, {}
    recorded = read_live(config.run_dir)
    if recorded is None:
        return config, {}
    return _resumed(config, recorded)


def settle_live(config: RunConfig, resumed: RunConfig) -> None:
    """Once the run holds its out_dir (a run refused there must not touch a live run's file): a new run sets
    the previous run's file aside; a resume that read a record writes it again at once, against its own config
    (a value its config set wins from then on, else a second resume took the first run's live value back)."""
    if not config.resume:
        forget_live(config.run_dir)
        return
    if read_live(config.run_dir) is None:
        return
    try:
        write_live(config.run_dir, LiveValues.of(config), LiveValues.of(resumed))
    except OSError as e:
        log.warning("could not record the resumed run's values", extra={"error": describe_os_error(e)})


def _resumed(config: RunConfig, recorded: tuple[LiveValues, LiveValues]) -> tuple[RunConfig, dict[str, int]]:
    configured, live = recorded
    now = LiveValues.of(config)
    taken: dict[str, int] = {}
    for key in ("max_staleness", "rollout_replicas"):
        was, value, current = getattr(configured, key), getattr(live, key), getattr(now, key)
        if current == was and value != current:
            taken[key] = value
        elif current != was:
            log.info("a config value set for the resume wins over the run's live change", extra={"key": key})
    if not taken:
        return config, {}
    update: dict[str, Any] = {}
    if "max_staleness" in taken:
        update["max_staleness"] = taken["max_staleness"]
    if "rollout_replicas" in taken:
        update["rollout"] = config.rollout.model_copy(update={"replicas": taken["rollout_replicas"]})
    log.warning("the run resumes with its live changes, not the config's values", extra={"live": taken})
    return config.model_copy(update=update), taken
