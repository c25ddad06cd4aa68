"""The trainer's checkpoint store: one folder per policy version, written atomically, found, read, pruned.

    root/v00000012/
      config.json, model.safetensors, …   # save_pretrained: from_pretrained(this folder) works
      tokenizer*.json, …                   # copied from the source model folder, when present
      trainer_state.pt                     # torch.save: optimizer, LR schedule, RNG states
      trainer_state.json                   # format, policy_version, created_at, algorithm, trained_group_ids,
                                           # files: each other file's bytes and sha256

A folder is written as ``root/.tmp-v…-<random>/``, fsynced, then renamed, so a checkpoint is complete or
absent; only folders that hold ``trainer_state.json`` count. A resume checks every file against the sizes and
digests written with it, so a damaged byte is found before training goes on from it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import pickle
import random
import re
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tauflow.core.files import fsync_dir
from tauflow.core.threads import started_executor

# 2: trainer_state.json carries the digest of its own fields ("digest") and its list of files is required. A
# flipped bit in its "policy_version" (30 to 70) had a resume skip 40 steps without a word, and one in the key
# "files" turned every file's check off. 1 (before): resumed, its fields checked.
log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 2
_READABLE_FORMATS = (1, 2)
STATE_JSON = "trainer_state.json"
STATE_TENSORS = "trainer_state.pt"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
)
_CHECKPOINT_NAME = re.compile(r"^v(\d{8,})$")


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    policy_version: int
    created_at: float
    """Unix time at which writing completed."""
    size_bytes: int
    trained_groups: int


def checkpoint_name(version: int) -> str:
    return f"v{version:08d}"


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest version first."""
    return [p for p in _version_folders(root) if (p / STATE_JSON).exists()]


def _version_folders(root: str | Path) -> list[Path]:
    """The ``v<version>`` folders under ``root``, complete or not, oldest version first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _CHECKPOINT_NAME.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: str | Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def checkpoint_to_resume(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root``: the one the trainer resumes from. Raises ValueError when a
    checkpoint folder newer than it lacks its trainer_state.json: a checkpoint is renamed into place only whole
    (``write_checkpoint``), so such a folder is damage, and resuming from the one before would lose the steps
    after it without a word (their leases were acked), as a damaged file would (``read_checkpoint_meta``). An
    older incomplete folder (a prune cut short) is passed over."""
    for folder in reversed(_version_folders(root)):
        if (folder / STATE_JSON).exists():
            return folder
        raise ValueError(f"{folder / STATE_JSON} is missing (the checkpoint is damaged): {_OLDER}")
    return None


def resolve_checkpoint(path: str | Path) -> Path:
    """``path`` itself when it is a checkpoint folder, else the newest checkpoint in it."""
    path = Path(path)
    if (path / STATE_JSON).exists():
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise FileNotFoundError(f"no tauflow trainer checkpoint in {path}")
    return latest


def read_checkpoint_info(path: str | Path) -> CheckpointInfo:
    """What the checkpoint at ``path`` is (its fields checked, not its files: ``read_checkpoint_meta``)."""
    path = Path(path)
    try:
        meta = json.loads((path / STATE_JSON).read_text())
    except ValueError as e:
        raise ValueError(f"{path / STATE_JSON} is damaged ({e}): {_OLDER}") from None
    _check_fields(meta, path)
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return CheckpointInfo(path, meta["policy_version"], meta["created_at"], size, len(meta["trained_group_ids"]))


def document_digest(document: Mapping[str, Any]) -> str:
    """The sha256 of a trainer_state.json's fields but its "digest" (sorted, compact JSON: the same after a
    round trip through the file)."""
    body = {key: value for key, value in document.items() if key != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _check_fields(meta: Any, path: Path) -> None:
    """ValueError naming the file unless ``meta`` is a trainer_state.json this trainer can resume from: a known
    format; its own digest (format 2); a version that is the folder's (``v<version>``, where the folder is so
    named); a creation time; the trained groups' ids."""

    def damaged(why: str) -> ValueError:
        return ValueError(f"{path / STATE_JSON} is damaged ({why}): {_OLDER}")

    if not isinstance(meta, dict):
        raise damaged("not a JSON object")
    if meta.get("format") not in _READABLE_FORMATS:
        raise ValueError(f"{path}: checkpoint format {meta.get('format')!r}, expected {CHECKPOINT_FORMAT}")
    if meta["format"] >= 2 and meta.get("digest") != document_digest(meta):
        raise damaged("its fields are not the ones written: their digest differs")
    version = meta.get("policy_version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise damaged(f"policy_version is {version!r}, not a version")
    named = _CHECKPOINT_NAME.match(path.name)
    if named and int(named.group(1)) != version:
        raise damaged(f"policy_version {version} is not its folder's, {int(named.group(1))}")
    created = meta.get("created_at")
    if isinstance(created, bool) or not isinstance(created, int | float):
        raise damaged(f"created_at is {created!r}, not a time")
    ids = meta.get("trained_group_ids")
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise damaged("trained_group_ids is not a list of group ids")
    if meta["format"] >= 2 and not isinstance(meta.get("files"), dict):
        raise damaged("its list of files is missing")


def write_checkpoint(
    root: str | Path,
    version: int,
    *,
    save_weights: Callable[[Path], None],
    tokenizer_source: Path,
    trainer_state: Callable[[], dict[str, Any]],
    meta: Mapping[str, Any],
    keep: int,
    own: bool = True,
    checksums: bool = True,
) -> CheckpointInfo:
    """Writes ``root/v{version:08d}/``: ``save_weights(folder)``, the tokenizer files found in
    ``tokenizer_source``, ``trainer_state()`` (torch.save) and ``meta`` (JSON, after format, version and
    creation time). The same checkpoint already there (this version, these trained groups: a retry) is
    returned as it is. Then keeps the newest ``keep`` checkpoints (0 keeps all).

    ``own``: ``root`` is the trainer's own checkpoint directory, whose other contents it manages (it removes
    a dead writer's leftovers and old checkpoints, and replaces a folder of this version that is another
    checkpoint or damaged). Elsewhere (an export) it removes nothing: another folder of this version there is
    refused (FileExistsError).

    ``checksums``: record each file's sha256 (read back after the write: about 1 GB/s on one core), checked
    at every resume; else only their sizes."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(version)
    if (final / STATE_JSON).exists():
        existing = _same_checkpoint(final, version, meta)
        if existing is not None:
            return existing
        if not own:
            raise FileExistsError(errno.EEXIST, f"{final.name} there holds another checkpoint of version {version}")
    if own:
        for leftover in root.glob(".tmp-*"):  # from a writer that died mid-way
            shutil.rmtree(leftover, ignore_errors=True)

    def write() -> None:
        tmp = root / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            save_weights(tmp)
            for name in TOKENIZER_FILES:
                src = tokenizer_source / name
                if src.is_file():
                    shutil.copy2(src, tmp / name)
            torch.save(trainer_state(), tmp / STATE_TENSORS)
            header = {"format": CHECKPOINT_FORMAT, "policy_version": version, "created_at": time.time()}
            # (its digest over what a reader gets back: JSON turns tuples into lists and keys into strings)
            document = json.loads(json.dumps({**header, **meta, "files": _file_digests(tmp, checksums)}))
            document["digest"] = document_digest(document)
            (tmp / STATE_JSON).write_text(json.dumps(document, indent=1))
            _fsync_tree(tmp)
            replaced = None
            if final.exists():  # incomplete, damaged or another run's: set aside until the new one is in place
                replaced = root / f".tmp-replaced-{final.name}-{uuid.uuid4().hex[:8]}"
                os.rename(final, replaced)
            os.rename(tmp, final)
            fsync_dir(root)
            if replaced is not None:
                shutil.rmtree(replaced, ignore_errors=True)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, Exception) and not isinstance(e, OSError) and out_of_space(e, root):
                # torch.save and safetensors report a full disk as their own errors: said as what it is
                raise OSError(errno.ENOSPC, f"no space left for the checkpoint ({type(e).__name__}: {e})") from e
            raise

    while True:
        try:
            write()
            break
        except OSError as e:
            # The disk full of this trainer's own older checkpoints: a new one is written whole before the old
            # ones go, so a disk that held `keep` of them and not one more never took another (70 steps
            # trained with nothing durable, every lease held). The oldest goes first then, one at a time,
            # never the newest whole one.
            full = own and keep >= 2 and out_of_space(e, root)  # (keep 0: every one, as asked)
            older = [p for p in list_checkpoints(root) if p != final] if full else []
            if len(older) < 2:
                raise
            log.warning(
                "no room for the checkpoint: the oldest kept one goes first",
                extra={"version": version, "removed": older[0].name, "kept": len(older) - 1},
            )
            shutil.rmtree(older[0], ignore_errors=True)
            if (older[0] / STATE_JSON).exists():  # (not removed: read-only, another owner) the disk stays full
                raise
    if own:
        prune(root, keep, spare=final)
    return read_checkpoint_info(final)


FULL_BELOW_BYTES = 16 * 2**20  # free space under which a failed write is taken for a full disk


def out_of_space(error: BaseException, root: Path) -> bool:
    """Whether ``error``, a failed checkpoint write into ``root``, came of a full disk: an ENOSPC or EDQUOT, a
    library's message saying so, or next to no free space left."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if "No space left" in str(error) or "os error 28" in str(error):
        return True
    try:
        return shutil.disk_usage(root).free < FULL_BELOW_BYTES
    except OSError:
        return False


def _same_checkpoint(folder: Path, version: int, meta: Mapping[str, Any]) -> CheckpointInfo | None:
    """``folder``'s checkpoint when it is the one about to be written (the same format, version and trained
    groups: written by an earlier call), else None (another run's, a damaged one)."""
    try:
        found = json.loads((folder / STATE_JSON).read_text())
        same = (
            found.get("format") == CHECKPOINT_FORMAT
            and found.get("policy_version") == version
            and found.get("trained_group_ids") == meta.get("trained_group_ids")
        )
        return read_checkpoint_info(folder) if same else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # unreadable, not JSON, not a dict
        return None


def prune(root: Path, keep: int, *, spare: Path) -> None:
    """Removes all but the newest ``keep`` checkpoints in ``root`` (0 keeps all), never ``spare``."""
    if keep <= 0:
        return
    for old in list_checkpoints(root)[:-keep]:
        if old != spare:
            shutil.rmtree(old, ignore_errors=True)


HASH_THREADS = 8  # files hashed at once (hashlib releases the GIL: a sharded checkpoint reads at the disk's pace)
_hash_pool: ThreadPoolExecutor | None = None
_hash_pool_lock = threading.Lock()


def hash_pool() -> ThreadPoolExecutor:
    """The threads that hash checkpoint files, started once (the trainer starts them before it serves): a pool
    made at each checkpoint started its threads mid-run, and one that could not start for want of memory left
    the checkpoint, and the trainer, waiting for good."""
    global _hash_pool
    with _hash_pool_lock:
        if _hash_pool is None:
            _hash_pool = started_executor(HASH_THREADS, "checkpoint-hash")
        return _hash_pool


def _sha256(file: Path) -> str:
    with open(file, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _file_digests(folder: Path, checksums: bool) -> dict[str, dict[str, Any]]:
    """Each file under ``folder`` (its path relative to it): its size and, with ``checksums``, its sha256."""
    files = [f for f in sorted(folder.rglob("*")) if f.is_file()]
    out: dict[str, dict[str, Any]] = {f.relative_to(folder).as_posix(): {"bytes": f.stat().st_size} for f in files}
    if checksums:
        for f, digest in zip(files, hash_pool().map(_sha256, files), strict=True):
            out[f.relative_to(folder).as_posix()]["sha256"] = digest
    return out


def read_checkpoint_meta(path: Path) -> dict[str, Any]:
    """The checkpoint's JSON metadata, once every file it lists is found whole: the size and sha256 written with
    it (a checkpoint written before they were recorded has no list). Refuses another format, and a damaged file
    naming it (the trainer does not fall back to an older checkpoint by itself: the leases of the steps after
    it were acked, so those steps would be lost without a word)."""
    try:
        meta = json.loads((path / STATE_JSON).read_text())
    except ValueError as e:
        raise ValueError(f"{path / STATE_JSON} is damaged ({e}): {_OLDER}") from None
    _check_fields(meta, path)
    files = meta.get("files", {})
    if not isinstance(files, dict):
        raise ValueError(f"{path / STATE_JSON} is damaged (its 'files' is not an object): {_OLDER}")  # noqa: TRY004
    found = list(hash_pool().map(lambda item: (path / item[0], _damage(path / item[0], item[1])), files.items()))
    for file, why in found:
        if why is not None:
            raise ValueError(f"{file} is damaged ({why}): {_OLDER}")
    return meta


def _damage(file: Path, written: Any) -> str | None:
    """How ``file`` differs from what was written (its size and digest), or None."""
    if not isinstance(written, dict):
        return "its entry in trainer_state.json is not an object"
    try:
        size = file.stat().st_size
    except FileNotFoundError:
        return "missing"
    if size != written.get("bytes"):
        return f"{size} bytes, written as {written.get('bytes')}"
    if "sha256" in written and _sha256(file) != written["sha256"]:
        return "its sha256 is not the one written"
    return None


def read_trainer_state(path: Path, meta: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The checkpoint's JSON metadata (``read_checkpoint_meta``: every file checked, unless ``meta`` is what it
    read) and its torch state (on the CPU), a damaged file refused naming it."""
    if meta is None:
        meta = read_checkpoint_meta(path)
    try:
        state = torch.load(path / STATE_TENSORS, map_location="cpu", weights_only=True)
    except (EOFError, pickle.UnpicklingError) as e:
        raise ValueError(f"{path / STATE_TENSORS} is damaged ({e}): {_OLDER}") from None
    except RuntimeError as e:
        if "PytorchStreamReader" not in str(e) and "zip" not in str(e):  # (not its file's: out of memory, say)
            raise
        raise ValueError(f"{path / STATE_TENSORS} is damaged ({e}): {_OLDER}") from None
    return meta, state


_OLDER = (
    "move that checkpoint folder aside to resume from the one before it (the groups trained after that one were "
    "acked: they do not come back)"
)


def _fsync_tree(path: Path) -> None:
    for f in sorted(path.rglob("*")):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    fsync_dir(path)


# -- random number generators: part of the state, so that a resumed run draws what the first would have


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if "numpy" in sys.modules:
        name, keys, pos, has_gauss, cached = sys.modules["numpy"].random.get_state()
        state["numpy"] = (name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached))
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
