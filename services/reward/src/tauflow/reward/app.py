"""Builds the reward service from its config: the registry, the worker pool, then serve."""

from __future__ import annotations

import logging

from tauflow.core.app import service_main
from tauflow.core.server import ServiceApp, ServiceBinding
from tauflow.reward import __version__, code_exec, worker
from tauflow.reward.adapters.servicer import SERVICE, RewardServicer, add_reward_servicer_to_server
from tauflow.reward.config import Executor, RewardConfig
from tauflow.reward.metrics import RewardMetrics
from tauflow.reward.registry import build_registry
from tauflow.reward.runner import Scorer

log = logging.getLogger(__name__)


async def build(config: RewardConfig) -> ServiceApp:
    registry = build_registry(config)
    for fn in registry.functions():
        log.info(
            "reward function",
            extra={"fn": fn.name, "executor": fn.executor.value, "timeout_s": fn.timeout_s, "source": fn.source},
        )
    if "code" in registry:
        code_exec.log_confinement(log)  # which of the sandbox's kernel layers this kernel has
    process_refs = [fn.ref for fn in registry.functions() if fn.executor is Executor.PROCESS]
    worker.not_dumpable()  # the service's environment (secrets) unreadable through /proc by its sandboxes
    scorer = Scorer(
        config.pool,
        process_refs,
        max_inline_call_s=config.max_inline_call_s,
        max_pool_call_s=config.max_pool_call_s,
    )
    await scorer.start()
    metrics = RewardMetrics()
    metrics.pool_workers.set(config.pool.workers)
    servicer = RewardServicer(registry, scorer, config, metrics)

    def close() -> None:
        scorer.close()  # (its workers joined: their pids run no more)
        code_exec.sweep_abandoned()

    return ServiceApp(
        bindings=[ServiceBinding(SERVICE, servicer, add_reward_servicer_to_server)],
        close=close,
        info={
            "reward_functions": [fn.name for fn in registry.functions()],
            "default_reward_fn": registry.default_name,
        },
    )


main = service_main(
    "reward",
    RewardConfig,
    build,
    __version__,
    description="tauflow reward: scores whole groups with pluggable reward functions, each call bounded by a timeout",
)
