"""Structured logs: ``key=value`` text for terminals, JSON lines for collectors.

Extra fields are passed the standard way, ``log.info("put", extra={"group_id": g})``,
and appear as keys in both formats.
"""

from __future__ import annotations

import logging
import sys
import time

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


class LogLimit:
    """For an event a caller or a fault can repeat at will (a refused token, a write to a full disk): says when
    to log it, at most once per ``every_s`` (the first at once), and how many came since the last line."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self._logged_at = -every_s  # (time.monotonic)
        self._count = 0

    def due(self) -> int:
        """Counts one event; returns how many to report now, this one included, or 0 when no line is due."""
        self._count += 1
        now = time.monotonic()
        if now - self._logged_at < self.every_s:
            return 0
        count, self._count, self._logged_at = self._count, 0, now
        return count


class GrpcDecodeErrors(logging.Filter):
    """grpcio logs every metadata value it cannot decode as UTF-8 at ERROR, with a traceback and the raw value
    (about 3 lines and up to 100 KB per call of a hostile client, a bearer token's bytes included). Keeps one
    short line per ``every_s``, with the value's length and how many were dropped, never the value."""

    def __init__(self, every_s: float = 60.0) -> None:
        super().__init__()
        self.limit = LogLimit(every_s)

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("Invalid encoding"):
            return True
        count = self.limit.due()
        if not count:
            return False
        value = record.args[0] if isinstance(record.args, tuple) and record.args else b""
        record.msg = "a request's metadata is not UTF-8 (value of %d bytes, not shown; %d more since the last line)"
        record.args = (len(value) if isinstance(value, (bytes, str)) else -1, count - 1)
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        return True


class CallerProvokedErrors(logging.Filter):
    """Error records, each with a traceback (about 1 KB), that any caller can provoke at will: one short WARNING
    line per ``every_s`` instead, saying how many were left out since, without the traceback. ``prefix``: how
    the records to limit begin (others pass as they are); ``line``: the WARNING's text, with ``%s`` for the
    exception's type and ``%d`` for the count left out."""

    def __init__(self, prefix: str, line: str, every_s: float = 60.0) -> None:
        super().__init__()
        self.prefix, self.line = prefix, line
        self.limit = LogLimit(every_s)

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(self.prefix):
            return True
        count = self.limit.due()
        if not count:
            return False
        error = record.exc_info[1] if record.exc_info else None
        record.msg = self.line
        record.args = (type(error).__name__ if error is not None else "no exception", count - 1)
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        return True


class UnsentAnswers(CallerProvokedErrors):
    """gRPC logs "ExecuteBatchError raised in core by servicer method" at ERROR with a traceback for each answer
    it could not send because its caller had gone (closed the connection, or never opened its flow-control
    window): a client that asks and leaves wrote 385 tracebacks in 20 s (health Check, no token needed)."""

    def __init__(self, every_s: float = 60.0) -> None:
        super().__init__(
            "ExecuteBatchError raised in core by servicer method",
            "an answer could not be sent (%s: its caller had gone); %d more since the last line",
            every_s,
        )


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
    grpc_log = logging.getLogger("grpc._cython.cygrpc")
    grpc_log.filters[:] = [f for f in grpc_log.filters if not isinstance(f, (GrpcDecodeErrors, UnsentAnswers))]
    grpc_log.addFilter(GrpcDecodeErrors())
    grpc_log.addFilter(UnsentAnswers())
