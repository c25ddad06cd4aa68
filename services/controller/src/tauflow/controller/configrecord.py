"""The config a run started with, and the one of its last start, kept in ``<out_dir>/run-config.json``, so
that a ``tauflow run --resume`` says what its config changed.

A resume may change the config on purpose (``--set steps=400`` to train longer, a larger ``eval.limit``) or by
mistake (another model folder, another data set, another algorithm). Either way, the run's curves and its
summary.json are read later as one run's: the summary records every key that differs from the config the run
started with, as ``resumed_config_changes: {"steps": [200, 400], ...}`` (dotted keys; ``[at the start, now]``;
against the start, not the last resume: a resume that died before its summary leaves no record of its change
otherwise), and the controller logs them once as the run starts. A new run (no ``--resume``) sets the previous
run's file aside (``run-config.json.prev``) as it does its checkpoints. The file holds the config with its
secrets redacted (secrets.py): a key that names a secret never reaches it, so a changed secret is not reported.

A file that cannot be read or is damaged is logged and the changes are not reported; one that cannot be
written is logged and the run goes on (only the next resume's report would miss it).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from tauflow.controller.config import RunConfig, flatten
from tauflow.controller.launcher import describe_os_error, read_json_file, replace_file
from tauflow.controller.secrets import redacted

log = logging.getLogger(__name__)

CONFIG_FILE = "run-config.json"
MAX_CONFIG_FILE_BYTES = 1024 * 1024  # (a run config is a few KB: anything larger is not ours)
_FORMAT = 1
# Keys whose change says nothing about what the run trains: how it was started and where its files are (a
# relative out_dir given absolute is the same run).
_NOT_COMPARED = {"resume", "out_dir", "token_file"}


def _values(config: RunConfig) -> dict[str, Any]:
    dumped = redacted(config.model_dump(mode="json"))
    assert isinstance(dumped, dict)
    return {k: v for k, v in flatten(dumped).items() if k not in _NOT_COMPARED}


def _read(path: Path) -> dict[str, Any] | None:
    """The config the run started with, as recorded, or None: no record, or one that is damaged (logged)."""
    try:
        record = read_json_file(path, MAX_CONFIG_FILE_BYTES)
        if (
            not isinstance(record, dict)
            or record.get("format") != _FORMAT
            or not isinstance(record.get("started"), dict)
        ):
            raise ValueError("not a run config record")
        values: dict[str, Any] = record["started"]
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("could not read the run's recorded config: %s", describe_os_error(e))
        return None
    except ValueError as e:  # (json.JSONDecodeError and UnicodeDecodeError are ValueErrors)
        log.warning("the run's recorded config is damaged; its changes are not reported (%s)", str(e)[:200])
        return None
    return values


def config_changes(before: dict[str, Any], after: dict[str, Any]) -> dict[str, list[Any]]:
    """Every dotted key whose value differs, ``[before, after]`` (None where a side has no such key)."""
    return {
        key: [before.get(key), after.get(key)]
        for key in sorted(before.keys() | after.keys())
        if before.get(key) != after.get(key)
    }


def settle_config(config: RunConfig) -> dict[str, list[Any]]:
    """Once the run holds its out_dir: a resume compares ``config`` with the one the run started with and
    returns what differs; a new run sets the previous record aside. Either way the record is written whole:
    the run's starting config (kept by a resume) and ``config``."""
    path = config.run_dir / CONFIG_FILE
    values = _values(config)
    changes: dict[str, list[Any]] = {}
    started = values
    if config.resume:
        recorded = _read(path)
        if recorded is not None:
            started = recorded
            changes = config_changes(recorded, values)
    else:
        try:
            path.replace(path.with_name(CONFIG_FILE + ".prev"))
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("could not set a previous run's config aside: %s", describe_os_error(e))
    try:
        text = json.dumps({"format": _FORMAT, "started": started, "config": values}, indent=1, sort_keys=True)
        replace_file(path, text.encode(), durable=True)
    except OSError as e:
        log.warning("could not record the run's config: %s", describe_os_error(e))
    if changes:  # (the keys in the text: this runs before tauflow run sets its log's format up)
        said = ", ".join(f"{key} {before!r} -> {after!r}" for key, (before, after) in changes.items())
        log.warning("the run resumes with a config that differs from the one it started with: %s", said[:2000])
    return changes
