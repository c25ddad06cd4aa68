"""What of a run's config, commands and messages is a secret, and the same with the secrets replaced.

GetRun shows the run's config to any client, and the run logs its prepare command and writes its failures
into the summary: none of them may carry a secret. A secret is found by the name it goes by:

- a key that names one (``HF_TOKEN``, ``webhookToken``, ``AWS_SECRET_ACCESS_KEY``, ``api_key``,
  ``Authorization``), not one that counts tokens (``max_new_tokens``, ``stop_token_ids``): its whole value;
- in a command, a list of arguments or a string: the argument after a flag that names one (``--api-key X``,
  ``--token X``, ``--password X``), the value of ``--flag=X`` and of ``NAME=X`` (an environment assignment);
- in a URL: its user info (``https://user:pass@host``, ``https://<token>@host``) and the value of every query
  parameter whose name looks like one (``?key=``, ``token``, ``sig``, ``signature``, ``auth``, ``password``...).
"""

from __future__ import annotations

import re

REDACTED = "<redacted>"

# a key that names a secret, not one that counts tokens
_SECRET_KEY = re.compile(
    r"secret|passw(or)?d|passphrase|credential|private_?key|access_?key|api[_-]?key|authorization|^auth$"
    r"|(^|[._-]|(?<=[a-z]))token$",
    re.IGNORECASE,
)
_FLAG_NAMES = {"key", "auth", "sig", "signature", "pass", "pwd"}  # a flag named so is followed by a secret
_HEADER = re.compile(r"^([A-Za-z][\w-]*):$")  # ``Authorization:`` / ``X-Api-Key:`` in a header's text
_AUTH_SCHEMES = {"bearer", "basic", "token", "digest"}  # ``Authorization: Bearer X``: the scheme, then the secret
_FLAG = re.compile(r"^--?([A-Za-z][\w-]*)$")
_FLAG_VALUE = re.compile(r"^(--?[A-Za-z][\w-]*)=(.*)$", re.DOTALL)
_ASSIGNMENT = re.compile(r"^([A-Za-z_][\w.-]*)=(.+)$", re.DOTALL)
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/?#@\s]+@")
_QUERY = re.compile(r"([?&;])([^=&#;\s]+)=([^&#;\s]*)")
_SECRET_PARAM = re.compile(r"key|token|secret|passw|pwd|sig|auth|credential|session|jwt", re.IGNORECASE)


def secret_key(name: object) -> bool:
    """Whether a config key (or an environment variable's name) names a secret."""
    return bool(_SECRET_KEY.search(str(name)))


def secret_flag(arg: str) -> bool:
    """Whether ``arg`` is a flag whose next argument is a secret (``--api-key``, ``--hf-token``, ``-password``)."""
    match = _FLAG.match(arg)
    if not match:
        return False
    name = match.group(1).replace("-", "_")
    return secret_key(name) or name.lower() in _FLAG_NAMES


def redact_url(text: str) -> str:
    """``text`` with the user info of its URLs and the values of their secret query parameters replaced."""
    text = _USERINFO.sub(lambda m: f"{m.group(1)}{REDACTED}@", text)
    return _QUERY.sub(
        lambda m: f"{m.group(1)}{m.group(2)}={REDACTED}" if _SECRET_PARAM.search(m.group(2)) else m.group(0), text
    )


def _redact_arg(arg: str) -> str:
    """One argument (no blank in it): ``--token=X``, ``HF_TOKEN=X``, or one with a URL in it."""
    if match := _FLAG_VALUE.match(arg):
        flag, value = match.groups()
        return f"{flag}={REDACTED}" if secret_flag(flag) else f"{flag}={redact_url(value)}"
    if (match := _ASSIGNMENT.match(arg)) and secret_key(match.group(1)):
        return f"{match.group(1)}={REDACTED}"
    return redact_url(arg)


def _redact_string(text: str, after_flag: bool = False) -> tuple[str, bool]:
    """``text`` (a command line, a message, a URL) redacted, and whether it ends with a secret flag (the next
    argument, in a list, is its value)."""
    parts = re.split(r"(\s+)", text)
    for i, part in enumerate(parts):
        if not part or part.isspace():
            continue
        if after_flag:
            if part.lower() in _AUTH_SCHEMES:
                continue  # (the scheme stays; the credential after it goes)
            parts[i], after_flag = REDACTED, False
            continue
        header = _HEADER.match(part)
        after_flag = secret_flag(part) or bool(header and secret_key(header.group(1)))
        if part.lower() == "bearer" and i + 2 < len(parts):  # ``-H "Bearer X"`` alone: the word after it
            after_flag = True
            continue
        parts[i] = _redact_arg(part)
    return "".join(parts), after_flag


def redact_text(text: str) -> str:
    """A command line or a message with its secrets replaced."""
    return _redact_string(text)[0]


def redact_command(args: list[str]) -> list[str]:
    """The arguments of a command with its secrets replaced."""
    return [r if isinstance(r, str) else str(r) for r in _redact_list(list(args))]


def _redact_list(values: list[object]) -> list[object]:
    out: list[object] = []
    after_flag = False
    for value in values:
        if after_flag and not isinstance(value, (dict, list)):
            out.append(REDACTED)
            after_flag = False
        elif isinstance(value, str):
            text, after_flag = _redact_string(value)
            out.append(text)
        else:
            out.append(redacted(value))
            after_flag = False
    return out


def redacted(config: object) -> object:
    """``config`` (a JSON-like value) with its secrets replaced (the module's docstring says which)."""
    if isinstance(config, dict):
        return {k: REDACTED if secret_key(k) else redacted(v) for k, v in config.items()}
    if isinstance(config, (list, tuple)):
        return _redact_list(list(config))
    if isinstance(config, str):
        return redact_text(config)
    return config
