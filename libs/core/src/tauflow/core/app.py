"""``service_main``: the command line that every service's ``__main__`` is made of.

``tauflow-<service> [--config FILE] [--set key=value ...] [--ready-file PATH]``
loads the typed config (file, then ``TAUFLOW_<SERVICE>_*`` environment, then
``--set``), sets up logs, tracing and metrics, builds the service and serves it
until SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Awaitable, Callable
from typing import TypeVar

from tauflow.core.config import ConfigError, ServiceConfig, load_config
from tauflow.core.logs import setup_logging
from tauflow.core.metrics import start_metrics_server
from tauflow.core.server import ServiceApp, serve
from tauflow.core.telemetry import setup_telemetry, shutdown_telemetry

ConfigT = TypeVar("ConfigT", bound=ServiceConfig)


def service_main(
    service: str,
    config_cls: type[ConfigT],
    build: Callable[[ConfigT], Awaitable[ServiceApp]],
    version: str,
    description: str = "",
) -> Callable[[list[str] | None], int]:
    def main(argv: list[str] | None = None) -> int:
        parser = argparse.ArgumentParser(prog=f"tauflow-{service}", description=description)
        parser.add_argument("--config", "-c", help="YAML, TOML or JSON config file")
        parser.add_argument(
            "--set", action="append", default=[], metavar="KEY=VALUE",
            help="override one config key, e.g. --set server.port=0 (repeatable)",
        )
        parser.add_argument("--ready-file", help="write the bound ports here as JSON once serving")
        parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
        parser.add_argument("--version", action="version", version=f"tauflow-{service} {version}")
        args = parser.parse_args(argv)
        try:
            config = load_config(
                config_cls,
                path=args.config,
                env_prefix=f"TAUFLOW_{service.upper()}_",
                overrides=args.set,
            )
        except ConfigError as e:
            print(f"tauflow-{service}: {e}", file=sys.stderr)
            return 2
        if args.print_config:
            print(config.model_dump_json(indent=2))
            return 0
        setup_logging(service, config.log.level, config.log.format)
        setup_telemetry(service, version)
        ready_info = {"service": service, "version": version}
        if config.metrics.enabled:
            ready_info["metrics_port"] = start_metrics_server(config.metrics.host, config.metrics.port)
        try:
            asyncio.run(_run(build, config, ready_info, args.ready_file))
        except Exception:
            logging.getLogger(f"tauflow.{service}").exception("service failed")
            return 1
        finally:
            shutdown_telemetry()
        return 0

    return main


async def _run(build, config, ready_info, ready_file) -> None:  # type: ignore[no-untyped-def]
    app = await build(config)
    await serve(app, config.server, ready_info=ready_info, ready_file=ready_file)
