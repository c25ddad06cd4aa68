"""Where the queue keeps the stored groups it cannot deliver: a folder beside the write-ahead log.

A group that no consumer can decode (written by an earlier build that validated less, or damaged on
disk) would fail every Get that includes it and come back after each lease expiry, for ever. The queue
evicts it instead (reason ``invalid``) and keeps its bytes here, one file per group with an index line,
so that an operator can see what was set aside and why. No grpc here.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

from tauflow.queue.model import GroupRecord

log = logging.getLogger(__name__)


class QuarantineFolder:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def __call__(self, group: GroupRecord, reason: str) -> None:
        """Keeps ``group``'s bytes and why it was set aside; a failure to write is logged, not raised:
        the group is evicted either way, so that it blocks no consumer."""
        digest = hashlib.sha256(group.group_id.encode()).hexdigest()[:16]
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            (self.path / f"{digest}.group").write_bytes(group.payload)
            entry = {"group_id": group.group_id, "file": f"{digest}.group", "why": reason, "at": time.time()}
            with open(self.path / "index.jsonl", "a") as index:
                index.write(json.dumps(entry) + "\n")
        except OSError as e:
            log.error("could not keep a quarantined group", extra={"group_id": group.group_id, "error": str(e)})

    def entries(self) -> list[dict[str, object]]:
        index = self.path / "index.jsonl"
        if not index.exists():
            return []
        return [json.loads(line) for line in index.read_text().splitlines() if line.strip()]
