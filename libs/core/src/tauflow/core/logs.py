"""Structured logs: ``key=value`` text for terminals, JSON lines for collectors.

Extra fields are passed the standard way, ``log.info("put", extra={"group_id": g})``,
and appear as keys in both formats.
"""

from __future__ import annotations

import logging
import sys

from pythonjsonlogger.json import JsonFormatter

_STANDARD_ATTRS = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        base = super().format(record)
        extras = " ".join(
            f"{k}={v!r}" if isinstance(v, str) and " " in v else f"{k}={v}"
            for k, v in vars(record).items()
            if k not in _STANDARD_ATTRS and not k.startswith("_")
        )
        return f"{base} {extras}" if extras else base


def setup_logging(service: str, level: str = "INFO", fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(
            JsonFormatter(
                "%(asctime)s %(levelname)s %(name)s %(message)s",
                rename_fields={"levelname": "level", "asctime": "time"},
                static_fields={"service": service},
            )
        )
    else:
        handler.setFormatter(KeyValueFormatter(f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
