"""Typed configuration: one loader for every service.

Sources, later ones winning: defaults in the model, a file (YAML, TOML or JSON),
environment variables ``<PREFIX>SECTION__KEY=value``, and ``key.sub=value``
command-line overrides. Values from the environment and the command line are
parsed as YAML scalars, so ``8`` is an int and ``true`` a bool. Every model
forbids unknown keys, and the error names the key and the source it came from.
A service's config also refuses two listening sockets on one port (``ServiceConfig``).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import logging
import os
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class ConfigError(ValueError):
    """A configuration that cannot be used; the message says which key and why."""


class StrictModel(BaseModel):
    """Base of every config section: unknown keys are errors, values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


MIN_MESSAGE_BYTES = 64 * 1024  # below this, health and reflection answers (a file descriptor each) may not fit
MAX_MESSAGE_BYTES = 2**31 - 1  # gRPC's channel arguments are int32


class ServerConfig(StrictModel):
    """Where and how a service's gRPC server listens."""

    host: str = "127.0.0.1"
    port: int = Field(50051, ge=0, le=65535, description="0 picks a free port")
    max_message_bytes: int = Field(
        256 * 1024 * 1024,
        ge=MIN_MESSAGE_BYTES,
        le=MAX_MESSAGE_BYTES,
        description="largest message received or sent (64 KiB to 2 GiB - 1: gRPC's limit is an int32)",
    )
    drain_grace_s: float = Field(10.0, ge=0, description="time in-flight calls get on SIGTERM")
    max_concurrent_rpcs: int = Field(
        10_000,
        ge=1,
        description="calls in progress at once, streams and long polls included (every client of a run's "
        "replicas together); one more is refused RESOURCE_EXHAUSTED",
    )
    max_concurrent_streams: int = Field(
        1_000,
        ge=1,
        description="calls one client connection may have in progress at once (HTTP/2); its further calls "
        "wait for one of them to end",
    )
    max_health_watches: int = Field(
        100,
        ge=0,
        description="health Watch streams open at once; one more is refused RESOURCE_EXHAUSTED (probes use Check)",
    )
    max_reflection_streams: int = Field(
        16,
        ge=0,
        le=10_000,
        description="server reflection streams open at once (grpcurl, buf curl); one more is refused "
        "RESOURCE_EXHAUSTED",
    )
    reflection_idle_s: float = Field(
        10.0,
        gt=0,
        le=3600,
        description="a reflection stream that sends no request for this long is ended (DEADLINE_EXCEEDED)",
    )
    max_connections: int = Field(
        4096,
        ge=1,
        le=1_000_000,
        description="client connections open at once on this port; one more is closed at once (its calls: "
        "UNAVAILABLE). Keep it under the process's open-files limit (raised to its hard limit at start)",
    )
    max_connection_idle_s: float = Field(
        300.0,
        ge=1,
        le=86_400,
        description="a connection with no call in progress for this long is closed (GOAWAY; a client "
        "reconnects at its next call)",
    )
    handshake_timeout_s: float = Field(
        10.0,
        ge=0.1,
        le=300,
        description="a new connection that has not completed its handshake (TLS, HTTP/2 preface) by then is closed",
    )


class MetricsConfig(StrictModel):
    """The Prometheus /metrics endpoint."""

    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = Field(9464, ge=0, le=65535, description="0 picks a free port")


class MediaConfig(StrictModel):
    """Where a service may read media URIs from, and the decoded bounds of a prompt's media parts
    (docs/omni.md); the wire bounds (parts, bytes, characters) are the contract's."""

    roots: list[str] = Field(
        default_factory=list,
        description="folders file:// media URIs may name (a volume every service mounts); none: URIs are refused",
    )
    max_image_pixels: int = Field(4096 * 4096, ge=1, description="pixels of one image, or of one video frame")
    max_audio_seconds: float = Field(
        600.0, gt=0, description="length of one sound at 48 kHz (its samples bound: a higher rate, fewer seconds)"
    )
    max_audio_rate: int = Field(192_000, ge=1, description="sample rate of a sound, in Hz")
    max_video_frames: int = Field(768, ge=1, description="frames of one video")
    max_video_pixels: int = Field(1 << 27, ge=1, description="pixels of one video, summed over its frames")
    max_prompt_pixels: int = Field(
        1 << 27, ge=1, description="pixels of all of a prompt's images and videos, for a model's processor"
    )


class DataConfig(StrictModel):
    """How a data set's rows become prompts and the reward's metadata (docs/data.md): which column holds what,
    and whether prompts go through the model's chat template. Read by tauflow.media.data_rows."""

    id_column: str = Field("id", min_length=1, description="the prompt's id (default: the row's index)")
    prompt_column: str = Field("prompt", min_length=1, description="the prompt as text")
    messages_column: str = Field(
        "messages", min_length=1, description="the prompt as a chat: a list of {role, content}"
    )
    answer_column: str = Field("answer", min_length=1, description="the reference answer (metadata 'answer')")
    metadata_columns: dict[str, str] = Field(
        default_factory=dict,
        description="more of the reward's metadata: key -> column (a value that is not a string goes as JSON)",
    )
    split: str = Field("train", min_length=1, description="the split of a DatasetDict saved with save_to_disk")
    chat_template: Literal["auto", "always", "never"] = Field(
        "auto",
        description="auto: chats go through the model's chat template, text as it is; always: text is asked as "
        "the user's turn of a chat too; never: text only (a chat is refused)",
    )
    system_prompt: str = Field("", description="a system turn put before every chat that has none")


class LogConfig(StrictModel):
    level: str = Field(
        "INFO", description="DEBUG, INFO, WARNING, ERROR or CRITICAL (DEBUG: start-up failures print their traceback)"
    )
    format: str = Field("text", pattern="^(text|json)$")

    @field_validator("level")
    @classmethod
    def _known_level(cls, value: str) -> str:
        level = value.strip().upper()
        if level not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise ValueError("must be DEBUG, INFO, WARNING, ERROR or CRITICAL")
        return level

    @property
    def debug(self) -> bool:
        return logging.getLevelName(self.level) <= logging.DEBUG


class AuthConfig(StrictModel):
    """The run token (tauflow.core.runtoken): the control methods of this process's server need it, and its
    channels send it."""

    token_file: str = Field(
        "",
        description="file holding the run's token (a mounted Secret; `tauflow run` writes one per run); "
        "empty: control methods are open to any caller",
    )


class ServiceConfig(StrictModel):
    """Sections every service has; a service's config subclasses this."""

    server: ServerConfig = ServerConfig()
    metrics: MetricsConfig = MetricsConfig()
    log: LogConfig = LogConfig()
    auth: AuthConfig = AuthConfig()

    @model_validator(mode="after")
    def _one_socket_per_port(self) -> ServiceConfig:
        # gRPC binds with SO_REUSEPORT off (tauflow.core.server), so a clash would fail at start anyway;
        # refusing it here names both keys, and catches a clash between sockets bound at different times.
        seen: dict[int, list[tuple[str, str]]] = {}
        for key, host, port in listening_sockets(self):
            for other_key, other_host in seen.get(port, []):
                if _same_interface(host, other_host):
                    raise ValueError(
                        f"{other_key} and {key} are both {port} on "
                        f"{host if other_host == host else f'{other_host} and {host}'}: "
                        "every listening socket needs its own port (0 picks a free one)"
                    )
            seen.setdefault(port, []).append((key, host))
        return self


ConfigT = TypeVar("ConfigT", bound=BaseModel)


def listening_sockets(config: BaseModel, prefix: str = "") -> list[tuple[str, str, int]]:
    """``(key, host, port)`` of every section of ``config`` that listens on a fixed port: any section with a
    ``host`` and a non-zero ``port`` (server, metrics, the queue's external port, the weights' store...),
    unless its ``enabled`` is false. A nested ServiceConfig is another process and is not searched."""
    found = []
    for name in type(config).model_fields:
        value = getattr(config, name)
        if not isinstance(value, BaseModel) or isinstance(value, ServiceConfig):
            continue
        key = f"{prefix}{name}"
        host, port = getattr(value, "host", None), getattr(value, "port", None)
        if isinstance(host, str) and isinstance(port, int) and port and getattr(value, "enabled", True) is not False:
            found.append((f"{key}.port", host, port))
        found += listening_sockets(value, f"{key}.")
    return found


_WILDCARDS = {"", "0.0.0.0", "::", "[::]", "*"}


def _same_interface(a: str, b: str) -> bool:
    """Whether sockets on hosts ``a`` and ``b`` would take the same port: the same address, or a wildcard."""
    if a in _WILDCARDS or b in _WILDCARDS:
        return True

    def norm(host: str) -> str:
        host = host.strip("[]").lower()
        if host == "localhost":
            return "127.0.0.1"
        try:
            return str(ipaddress.ip_address(host))
        except ValueError:
            return host

    return norm(a) == norm(b)


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config file {p}: {e.strerror}") from e
    try:
        if p.suffix == ".toml":
            data = tomllib.loads(text)
        elif p.suffix == ".json":
            data = json.loads(text)
        else:
            data = yaml.safe_load(text)
    except (yaml.YAMLError, tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"config file {p} does not parse: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must hold a mapping at the top, not {type(data).__name__}")
    return data


def _set_path(data: dict[str, Any], path: list[str], value: Any, source: str) -> None:
    node = data
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{source}: '{part}' is a value, not a section")
        node = child
    node[path[-1]] = value


def deep_merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """``top`` over ``base``, mappings merged key by key; neither is changed."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def parse_value(text: str) -> Any:
    """A value as the environment and `--set` give it: YAML (a number, a list, `{a: 1}`), else the text."""
    if text == "":
        return ""  # `--set key=` sets an empty string (YAML would read it as null)
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def environment_over(
    data: dict[str, Any],
    env_prefix: str,
    environ: Mapping[str, str],
    origin: dict[tuple[str, ...], str] | None = None,
) -> dict[str, Any]:
    """``data`` with the variables ``<env_prefix><KEY>__<SUB>`` of ``environ`` over it, as a service reads its
    environment over its config file (a value parsed as YAML; ``origin`` records where each key came from)."""
    for name in sorted(environ):
        if name.startswith(env_prefix) and len(name) > len(env_prefix):
            keys = name[len(env_prefix) :].lower().split("__")
            layer: dict[str, Any] = {}
            _set_path(layer, keys, parse_value(environ[name]), f"environment variable {name}")
            data = deep_merge(data, layer)
            if origin is not None:
                origin[tuple(keys)] = f"environment variable {name}"
    return data


def load_config(
    model: type[ConfigT],
    *,
    path: str | os.PathLike[str] | None = None,
    env_prefix: str | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Iterable[str] = (),
) -> ConfigT:
    """Builds ``model`` from file, environment and ``key=value`` overrides."""
    data: dict[str, Any] = read_config_file(path) if path else {}
    origin: dict[tuple[str, ...], str] = {}
    if env_prefix:
        data = environment_over(data, env_prefix, os.environ if environ is None else environ, origin)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} must look like key.sub=value")
        keys = key.strip().split(".")
        layer: dict[str, Any] = {}
        _set_path(layer, keys, parse_value(value), f"override {item!r}")
        data = deep_merge(data, layer)
        origin[tuple(keys)] = f"override {item!r}"
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_explain(e, origin, path, model)) from None


def _sections(cls: Any) -> dict[str, tuple[Any, bool]]:
    """A config section's fields, each as (its type where it is a section, whether it is required); {} for a
    value. Sections are pydantic models or dataclasses (a backend's own config)."""
    if isinstance(cls, type) and issubclass(cls, BaseModel):
        return {name: (f.annotation, f.is_required()) for name, f in cls.model_fields.items()}
    if isinstance(cls, type) and dataclasses.is_dataclass(cls):
        missing = dataclasses.MISSING
        return {f.name: (None, f.default is missing and f.default_factory is missing) for f in dataclasses.fields(cls)}
    return {}


def _required_keys(model: type[BaseModel], loc: tuple[str, ...]) -> list[str]:
    """The keys a missing section at ``loc`` needs (``backend`` missing: ``backend.model_path``), so that the
    error names what to set; [] where ``loc`` is no section of ``model``."""
    section: Any = model
    for part in loc:
        section = _sections(section).get(part, (None, False))[0]
    keys = []
    for name, (inner, required) in _sections(section).items():
        if required:
            below = _required_keys(inner, ()) if inner is not None else []
            keys += [f"{name}.{k}" for k in below] or [name]
    return [".".join([*loc, k]) for k in keys]


def _explain(
    error: ValidationError, origin: Mapping[tuple[str, ...], str], path: Any, model: type[BaseModel] | None = None
) -> str:
    lines = []
    for err in error.errors():
        loc = tuple(str(p) for p in err["loc"])
        key = ".".join(loc) or "<top>"
        where = origin.get(loc) or (f"config file {path}" if path else "defaults")
        required = _required_keys(model, loc) if model is not None and err["type"] == "missing" else []
        if err["type"] == "missing":  # (no value came from anywhere: name the keys to set, not a source)
            for name in required or [key]:
                lines.append(f"config key '{name}' is required and not set")
        elif not loc and err["type"] == "value_error":  # a check across sections: its message names the keys
            lines.append(str(err["ctx"]["error"]) if "ctx" in err else err["msg"])
        elif err["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
            lines.append(f"unknown config key '{key}' (from {where})")
        else:
            lines.append(f"config key '{key}' (from {where}): {err['msg']}")
    return "invalid configuration: " + "; ".join(lines)


class ChannelConfig(StrictModel):
    """A client channel's settings (tauflow.core.channel builds the channel)."""

    default_timeout_s: float = Field(30.0, gt=0, description="deadline of calls that set none")
    max_message_bytes: int = Field(256 * 1024 * 1024, gt=0)
    keepalive_time_s: float = Field(30.0, gt=0)
    keepalive_timeout_s: float = Field(10.0, gt=0)
    retry_max_attempts: int = Field(5, ge=2, le=5, description="gRPC caps attempts at 5")
    retry_initial_backoff_s: float = Field(0.1, gt=0)
    retry_max_backoff_s: float = Field(2.0, gt=0)
    # None: the contracts' retry codes (tauflow.api.retry.RETRY_STATUS_CODES: UNAVAILABLE, CANCELLED), read by
    # tauflow.core.channel (this module speaks no wire: domain code reads it)
    retry_status_codes: list[str] | None = None
