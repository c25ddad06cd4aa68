"""Typed configuration: one loader for every service.

Sources, later ones winning: defaults in the model, a file (YAML, TOML or JSON),
environment variables ``<PREFIX>SECTION__KEY=value``, and ``key.sub=value``
command-line overrides. Values from the environment and the command line are
parsed as YAML scalars, so ``8`` is an int and ``true`` a bool. Every model
forbids unknown keys, and the error names the key and the source it came from.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError


class ConfigError(ValueError):
    """A configuration that cannot be used; the message says which key and why."""


class StrictModel(BaseModel):
    """Base of every config section: unknown keys are errors, values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ServerConfig(StrictModel):
    """Where and how a service's gRPC server listens."""

    host: str = "127.0.0.1"
    port: int = Field(50051, ge=0, le=65535, description="0 picks a free port")
    max_message_bytes: int = Field(
        256 * 1024 * 1024, gt=0, description="largest message received or sent"
    )
    drain_grace_s: float = Field(10.0, ge=0, description="time in-flight calls get on SIGTERM")


class MetricsConfig(StrictModel):
    """The Prometheus /metrics endpoint."""

    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = Field(9464, ge=0, le=65535, description="0 picks a free port")


class LogConfig(StrictModel):
    level: str = "INFO"
    format: str = Field("text", pattern="^(text|json)$")


class ServiceConfig(StrictModel):
    """Sections every service has; a service's config subclasses this."""

    server: ServerConfig = ServerConfig()
    metrics: MetricsConfig = MetricsConfig()
    log: LogConfig = LogConfig()


ConfigT = TypeVar("ConfigT", bound=BaseModel)


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


def _deep_merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _scalar(text: str) -> Any:
    if text == "":
        return ""  # `--set key=` sets an empty string (YAML would read it as null)
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


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
        env = os.environ if environ is None else environ
        for name in sorted(env):
            if name.startswith(env_prefix) and len(name) > len(env_prefix):
                keys = name[len(env_prefix) :].lower().split("__")
                layer: dict[str, Any] = {}
                _set_path(layer, keys, _scalar(env[name]), f"environment variable {name}")
                data = _deep_merge(data, layer)
                origin[tuple(keys)] = f"environment variable {name}"
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} must look like key.sub=value")
        keys = key.strip().split(".")
        layer = {}
        _set_path(layer, keys, _scalar(value), f"override {item!r}")
        data = _deep_merge(data, layer)
        origin[tuple(keys)] = f"override {item!r}"
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_explain(e, origin, path)) from None


def _explain(error: ValidationError, origin: Mapping[tuple[str, ...], str], path: Any) -> str:
    lines = []
    for err in error.errors():
        loc = tuple(str(p) for p in err["loc"])
        key = ".".join(loc) or "<top>"
        where = origin.get(loc) or (f"config file {path}" if path else "defaults")
        if err["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
            lines.append(f"unknown config key '{key}' (from {where})")
        else:
            lines.append(f"config key '{key}' (from {where}): {err['msg']}")
    return "invalid configuration: " + "; ".join(lines)
