"""The external port's client tokens: a file of ``client_name: token`` lines (a YAML mapping).

The file, not the config or the environment, holds the tokens: ``--print-config`` prints the config and
a process's environment is readable in /proc and inherited by its children, while a file can be a
mounted secret readable by the queue alone. It is re-read when it changes (checked at most once per
``reload_interval_s``), so a client is added or a token rotated without restarting the queue; an edit
that does not parse is logged and ignored, the tokens in force stay. No grpc here.

No error quotes the file: a YAML error's usual excerpt, or a value in the wrong place (a token where a
name belongs, names and tokens swapped), would put a token in a log or on a terminal. Errors say the
file, line and column instead.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

import yaml

log = logging.getLogger(__name__)

CLIENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
MIN_TOKEN_CHARS = 16
MAX_TOKEN_CHARS = 1024
MAX_FILE_BYTES = 1024 * 1024
MAX_CLIENTS = 10_000
_STR = "tag:yaml.org,2002:str"
UNKNOWN_CLIENT = "unknown"  # the metrics' client label for a missing or unknown token: no client may be named so


class TokensError(ValueError):
    """A tokens file that cannot be used; the message names the file and the entry."""


def _digest(token: str) -> bytes:
    # Look-ups compare fixed-size digests, so their timing says nothing about how much of a token matched.
    return hashlib.sha256(token.encode()).digest()


def _where(source: str, mark: yaml.Mark | None) -> str:
    return f"{source}, line {mark.line + 1}, column {mark.column + 1}" if mark is not None else source


def parse_tokens(text: str, source: str) -> dict[bytes, str]:
    """``{sha256(token): client name}`` from the file's text."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)  # nodes, not values: each knows its line
    except yaml.MarkedYAMLError as e:
        raise TokensError(
            f"{_where(source, e.problem_mark or e.context_mark)}: does not parse as YAML `client_name: token` lines"
        ) from None
    except (yaml.YAMLError, RecursionError):
        raise TokensError(f"{source} does not parse as YAML") from None
    if root is None:
        return {}
    if not isinstance(root, yaml.MappingNode):
        kind = "sequence" if isinstance(root, yaml.SequenceNode) else "scalar"  # (a document's other roots)
        raise TokensError(f"{source} must hold `client_name: token` lines, not a YAML {kind}")
    if len(root.value) > MAX_CLIENTS:
        raise TokensError(f"{source} holds {len(root.value)} entries; at most {MAX_CLIENTS}")
    table: dict[bytes, str] = {}
    lines: dict[str, int] = {}  # client name -> its line
    token_lines: dict[bytes, int] = {}
    for key, value in root.value:
        line = key.start_mark.line + 1
        name = key.value if isinstance(key, yaml.ScalarNode) and key.tag == _STR else None
        if name is None or not CLIENT_NAME.fullmatch(name) or name == UNKNOWN_CLIENT:
            raise TokensError(
                f"{_where(source, key.start_mark)}: a client name must be 1-64 letters, digits, '.', '_' or '-' "
                f"(and not {UNKNOWN_CLIENT!r})"
            )
        if name in lines:
            raise TokensError(f"{source}: lines {lines[name]} and {line} name the same client")
        token = value.value if isinstance(value, yaml.ScalarNode) and value.tag == _STR else None
        if token is None or not MIN_TOKEN_CHARS <= len(token) <= MAX_TOKEN_CHARS or any(c.isspace() for c in token):
            raise TokensError(
                f"{_where(source, value.start_mark)}: a token must be a string of {MIN_TOKEN_CHARS} to "
                f"{MAX_TOKEN_CHARS} characters without spaces "
                "(e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')"
            )
        digest = _digest(token)
        if digest in table:
            raise TokensError(
                f"{source}: lines {token_lines[digest]} and {line} share a token; each client needs its own"
            )
        table[digest], lines[name], token_lines[digest] = name, line, line
    return table


class TokenTable:
    """Client names by bearer token, from ``path``, kept in step with the file."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        reload_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = Path(path)
        self.reload_interval_s = reload_interval_s
        self.clock = clock
        self._stamp = self._stat()
        self._table = parse_tokens(self._read(), str(self.path))  # a bad file at start is an error
        self._checked = clock()

    @property
    def clients(self) -> list[str]:
        return sorted(set(self._table.values()))

    def lookup(self, token: str) -> str | None:
        """The client that holds ``token``; None when no client does."""
        self._maybe_reload()
        return self._table.get(_digest(token)) if token else None

    def _stat(self) -> tuple[int, int, int]:
        try:
            st = self.path.stat()
        except OSError as e:
            raise TokensError(f"cannot read the tokens file {self.path}: {e.strerror}") from e
        return st.st_ino, st.st_mtime_ns, st.st_size

    def _read(self) -> str:
        try:
            with self.path.open("rb") as f:
                data = f.read(MAX_FILE_BYTES + 1)
        except OSError as e:
            raise TokensError(f"cannot read the tokens file {self.path}: {e.strerror}") from e
        if len(data) > MAX_FILE_BYTES:
            raise TokensError(f"the tokens file {self.path} is larger than {MAX_FILE_BYTES} bytes")
        try:
            return data.decode()
        except UnicodeDecodeError as e:
            raise TokensError(f"the tokens file {self.path} is not UTF-8 text (byte {e.start})") from None

    def _maybe_reload(self) -> None:
        now = self.clock()
        if now - self._checked < self.reload_interval_s:
            return
        self._checked = now
        error: TokensError | None = None
        try:
            stamp = self._stat()
        except TokensError as e:
            stamp, error = _GONE, e
        else:
            if stamp == self._stamp:
                return
            try:
                table = parse_tokens(self._read(), str(self.path))
            except TokensError as e:
                error = e
        if error is not None:
            if stamp != self._stamp:  # once per bad version of the file, not once per check
                log.error("tokens file not reloaded; the tokens in force stay", extra={"error": str(error)})
            self._stamp = stamp
            return
        self._stamp, self._table = stamp, table
        log.info("tokens file reloaded", extra={"clients": self.clients})


_GONE = (0, 0, 0)  # the stamp of a file that cannot be read
