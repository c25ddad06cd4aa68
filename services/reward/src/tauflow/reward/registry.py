"""The registry of reward functions: built-ins, ``tauflow.rewards`` entry points, per-function settings.

A function is registered under a name with its reference (``"module:qualname"``, how a worker process
finds it again) and its defaults, read from the object's attributes (see the README) and overridden
by the service's ``functions.<name>`` settings. ``resolve_config`` merges a request's config over the
defaults and validates it once per call. The defaults of a function's ``ceiling_keys`` (the ``code``
sandbox's limits, ``remote_rm``'s retries and concurrency) are ceilings: a request may lower them, never
raise them, so that the operator's limits hold whatever a client sends.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from importlib import metadata
from typing import Any

from tauflow.reward import builtins, compose, worker
from tauflow.reward.api import ENTRY_POINT_GROUP
from tauflow.reward.config import Executor, FunctionSettings, RewardConfig
from tauflow.reward.errors import InvalidRequest, NotFound, cut, shown

log = logging.getLogger(__name__)

BUILTINS: dict[str, tuple[str, Executor]] = {
    "exact_match": ("tauflow.reward.builtins:ExactMatch", Executor.INLINE),
    "format": ("tauflow.reward.builtins:Format", Executor.INLINE),
    "math": ("tauflow.reward.builtins:Math", Executor.PROCESS),
    "qa": ("tauflow.reward.answers:QuestionAnswering", Executor.INLINE),
    "multiple_choice": ("tauflow.reward.answers:MultipleChoice", Executor.INLINE),
    "ifeval": ("tauflow.reward.ifeval:InstructionFollowing", Executor.PROCESS),
    "remote_rm": ("tauflow.reward.adapters.remote:RemoteRewardModel", Executor.PROCESS),
    "code": ("tauflow.reward.code_exec:CodeExecution", Executor.PROCESS),
    "genrm": ("tauflow.reward.adapters.genrm:GenerativeJudge", Executor.PROCESS),
}
# A weighted sum of the others: its validation reads the registry (see ``build_registry``).
COMPOSE = ("compose", "tauflow.reward.compose:Compose")


class RegistryError(ValueError):
    """A registration or a setting that cannot be used; raised at start-up."""


@dataclass(frozen=True)
class RewardFunction:
    name: str
    ref: str
    description: str
    default_config: dict[str, Any]
    timeout_s: float
    fallback_score: float
    group_level: bool
    uses_token_ids: bool
    executor: Executor
    source: str
    isolated_keys: frozenset[str] = frozenset()
    service_only_keys: frozenset[str] = frozenset()
    ceiling_keys: frozenset[str] = frozenset()
    uses_prompt_parts: bool = False
    validate: Callable[[dict[str, Any]], dict[str, Any] | None] | None = field(default=None, compare=False)

    def resolve_config(self, overrides: Mapping[str, Any] | None, *, from_request: bool = True) -> dict[str, Any]:
        """``overrides`` over the defaults, validated; ``InvalidRequest`` names the key (``config.<key>``). A
        request may not set the function's ``service_only_keys`` (an address, the name of a secret), nor
        raise one of its ``ceiling_keys`` (a limit) above the default, which is the operator's setting."""
        overrides = dict(overrides or {})
        if from_request:
            locked = sorted(self.service_only_keys.intersection(overrides))
            if locked:
                raise InvalidRequest(
                    f"config.{locked[0]}",
                    f"set only in the service's settings (functions.{self.name}.config), not by a request",
                )
        unknown = sorted(set(overrides) - set(self.default_config))
        if unknown:
            keys = ", ".join(sorted(self.default_config)) or "none"
            raise InvalidRequest(
                f"config.{cut(unknown[0])}",
                f"unknown key for reward function {self.name!r} (its keys: {keys})",
            )
        merged = {**self.default_config, **overrides}
        if self.validate is not None:
            try:
                result = self.validate(merged)
            except builtins.ConfigInvalid as e:
                raise InvalidRequest(
                    f"config.{e.key}" if e.key else "config", f"{e.problem} (reward function {self.name!r})"
                ) from None
            except (ValueError, TypeError) as e:
                raise InvalidRequest("config", f"{str(e)[:500]} (reward function {self.name!r})") from None
            merged = merged if result is None else dict(result)
        if from_request:
            self._check_ceilings(overrides, merged)
        return merged

    def _check_ceilings(self, overrides: Mapping[str, Any], merged: Mapping[str, Any]) -> None:
        """``InvalidRequest`` for a ceiling key that the request sets above the service's value."""
        for key in sorted(self.ceiling_keys.intersection(overrides)):
            value, ceiling = merged.get(key), self.default_config.get(key)
            if isinstance(ceiling, bool) or not isinstance(ceiling, int | float):
                continue  # a default that is no number is no ceiling
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise InvalidRequest(f"config.{key}", f"must be a number (reward function {self.name!r})")
            if value > ceiling:
                raise InvalidRequest(
                    f"config.{key}",
                    f"{value!r} is over this service's ceiling of {ceiling!r} (functions.{self.name}.config."
                    f"{key}): a request may only lower it (reward function {self.name!r})",
                )

    def executor_for(self, overrides: Mapping[str, Any]) -> Executor:
        """Where a call with these request ``overrides`` runs: in the pool when the request sets one of the
        function's ``isolated_keys`` (e.g. a regular expression), whose work only a killable process bounds."""
        if self.executor is Executor.INLINE and not self.isolated_keys.isdisjoint(overrides):
            return Executor.PROCESS
        return self.executor


def _first_line(doc: str | None) -> str:
    return (doc or "").strip().split("\n\n")[0].replace("\n", " ").strip()


def describe(
    name: str,
    obj: Any,
    ref: str,
    *,
    source: str,
    executor: Executor,
    default_timeout_s: float,
    default_fallback_score: float,
) -> RewardFunction:
    """Reads a function's (or class's) attributes into a ``RewardFunction``; ``RegistryError`` if unusable."""
    if not callable(obj):
        raise RegistryError(f"reward function {name!r} ({ref}) is a {type(obj).__name__}, not a callable or class")
    default_config = getattr(obj, "default_config", None) or {}
    if not isinstance(default_config, Mapping) or not all(isinstance(k, str) for k in default_config):
        raise RegistryError(f"reward function {name!r}: default_config must be a mapping with string keys")
    try:
        json.dumps(dict(default_config), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise RegistryError(f"reward function {name!r}: default_config must be JSON-like ({e})") from None
    timeout_s = getattr(obj, "timeout_s", None)
    fallback = getattr(obj, "fallback_score", None)
    validate = getattr(obj, "validate_config", None)
    return RewardFunction(
        name=name,
        ref=ref,
        description=str(getattr(obj, "description", None) or _first_line(getattr(obj, "__doc__", None))),
        default_config=dict(default_config),
        timeout_s=float(timeout_s) if timeout_s is not None else default_timeout_s,
        fallback_score=float(fallback) if fallback is not None else default_fallback_score,
        group_level=bool(getattr(obj, "group_level", False)),
        uses_token_ids=bool(getattr(obj, "uses_token_ids", False)),
        uses_prompt_parts=bool(getattr(obj, "uses_prompt_parts", False)),
        executor=executor,
        source=source,
        isolated_keys=frozenset(getattr(obj, "isolated_keys", None) or ()),
        service_only_keys=frozenset(getattr(obj, "service_only_keys", None) or ()),
        ceiling_keys=frozenset(getattr(obj, "ceiling_keys", None) or ()),
        validate=validate if callable(validate) else None,
    )


class Registry:
    def __init__(self, default_name: str = "") -> None:
        self._fns: dict[str, RewardFunction] = {}
        self.default_name = default_name
        self.load_errors: dict[str, str] = {}

    def add(self, fn: RewardFunction) -> RewardFunction:
        if fn.name in self._fns:
            raise RegistryError(f"reward function {fn.name!r} is already registered ({self._fns[fn.name].source})")
        self._fns[fn.name] = fn
        return fn

    def register(
        self,
        name: str,
        obj: Any,
        *,
        ref: str | None = None,
        executor: Executor = Executor.PROCESS,
        source: str = "registered",
        default_timeout_s: float = 10.0,
        default_fallback_score: float = 0.0,
    ) -> RewardFunction:
        """Registers an object. Without ``ref`` it is found by its module and qualified name; an inline
        function is called through the object itself, so it need not be importable."""
        if ref is None:
            ref = f"{obj.__module__}:{obj.__qualname__}"
        fn = describe(
            name,
            obj,
            ref,
            source=source,
            executor=executor,
            default_timeout_s=default_timeout_s,
            default_fallback_score=default_fallback_score,
        )
        if executor is Executor.INLINE:
            worker.register_local(ref, obj() if isinstance(obj, type) else obj)
        return self.add(fn)

    def replace(self, fn: RewardFunction) -> None:
        self._fns[fn.name] = fn

    def remove(self, name: str) -> None:
        self._fns.pop(name, None)

    def get(self, name: str) -> RewardFunction:
        if not name:
            if not self.default_name:
                raise InvalidRequest("reward_fn", "empty, and this service has no default_reward_fn")
            name = self.default_name
        fn = self._fns.get(name)
        if fn is None:
            known = ", ".join(sorted(self._fns)) or "none"
            why = f" (it failed to load: {self.load_errors[name]})" if name in self.load_errors else ""
            raise NotFound(f"reward_fn {shown(name)} is not a registered reward function{why}; registered: {known}")
        return fn

    def __contains__(self, name: object) -> bool:
        return name in self._fns

    def functions(self) -> list[RewardFunction]:
        return [self._fns[n] for n in sorted(self._fns)]


def _entry_points() -> Iterable[metadata.EntryPoint]:
    return metadata.entry_points(group=ENTRY_POINT_GROUP)


def build_registry(config: RewardConfig, entry_points: Iterable[metadata.EntryPoint] | None = None) -> Registry:
    """Built-ins, then entry points (a name already taken is skipped with a warning), then settings."""
    reg = Registry()
    defaults = {"default_timeout_s": config.default_timeout_s, "default_fallback_score": config.default_fallback_score}
    for name, (ref, executor) in BUILTINS.items():
        reg.add(describe(name, worker.load_object(ref), ref, source="built-in", executor=executor, **defaults))
    if config.load_entry_points:
        for ep in _entry_points() if entry_points is None else entry_points:
            dist = getattr(ep.dist, "name", None) or "unknown distribution"
            source = f"entry point {ep.name} = {ep.value} ({dist})"
            if ep.name in reg:
                log.warning("reward entry point skipped: name taken", extra={"entry_point": source})
                continue
            try:
                obj = ep.load()
                reg.add(describe(ep.name, obj, ep.value, source=source, executor=Executor.PROCESS, **defaults))
            except Exception as e:  # noqa: BLE001 - a broken plug-in must not stop the service
                reg.load_errors[ep.name] = f"{type(e).__name__}: {e}"
                log.warning("reward entry point failed to load", extra={"entry_point": source, "error": str(e)})
    name, ref = COMPOSE
    composed = describe(name, worker.load_object(ref), ref, source="built-in", executor=Executor.PROCESS, **defaults)
    reg.add(replace(composed, validate=functools.partial(compose.resolved, reg)))
    # compose's settings last: its parts' configs are resolved against their functions' settled defaults
    for name, settings in sorted(config.functions.items(), key=lambda item: item[0] == COMPOSE[0]):
        _apply(reg, name, settings)
    if config.default_reward_fn and config.default_reward_fn not in reg:
        raise RegistryError(
            f"default_reward_fn {config.default_reward_fn!r} is not a registered reward function; "
            f"registered: {', '.join(f.name for f in reg.functions())}"
        )
    reg.default_name = config.default_reward_fn
    return reg


def _apply(reg: Registry, name: str, settings: FunctionSettings) -> None:
    if name not in reg:
        why = f" (it failed to load: {reg.load_errors[name]})" if name in reg.load_errors else ""
        raise RegistryError(f"functions.{name}: no reward function of that name is registered{why}")
    if not settings.enabled:
        reg.remove(name)
        return
    fn = reg.get(name)
    try:
        default_config = fn.resolve_config(settings.config, from_request=False)
    except InvalidRequest as e:
        raise RegistryError(f"functions.{name}.{e}") from None
    reg.replace(
        replace(
            fn,
            default_config=default_config,
            timeout_s=settings.timeout_s if settings.timeout_s is not None else fn.timeout_s,
            fallback_score=settings.fallback_score if settings.fallback_score is not None else fn.fallback_score,
            executor=settings.executor or fn.executor,
        )
    )
