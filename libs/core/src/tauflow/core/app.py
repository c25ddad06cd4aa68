"""``service_main``: the command line that every service's ``__main__`` is made of.

``tauflow-<service> [--config FILE] [--set key=value ...] [--ready-file PATH]``
loads the typed config (file, then ``TAUFLOW_<SERVICE>_*`` environment, then
``--set``), sets up logs, tracing and metrics, builds the service and serves it
until SIGTERM.

Exit codes: 0 after a drain, 2 when the service cannot start (any exception before it serves: the
config, the metrics port, ``build``, binding), 1 when it fails while serving. A failure to start is one
line on stderr, ``tauflow-<service>: <why>``, with the traceback only at ``log.level=DEBUG``: it is an
operator's mistake to fix (a port in use, a missing file), not a bug to report.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

from tauflow.core.config import ConfigError, ServiceConfig, load_config
from tauflow.core.logs import setup_logging
from tauflow.core.metrics import start_metrics_server
from tauflow.core.runtoken import load_run_token, run_token
from tauflow.core.server import ServiceApp, serve
from tauflow.core.telemetry import setup_telemetry, shutdown_telemetry
from tauflow.core.threads import started_executor

ConfigT = TypeVar("ConfigT", bound=ServiceConfig)


class ServiceMain(Protocol):
    """A service's ``main``: argv (None: ``sys.argv[1:]``) in, exit code out."""

    def __call__(self, argv: list[str] | None = None) -> int: ...


def service_main(
    service: str,
    config_cls: type[ConfigT],
    build: Callable[[ConfigT], Awaitable[ServiceApp]],
    version: str,
    description: str = "",
) -> ServiceMain:
    def main(argv: list[str] | None = None) -> int:
        parser = argparse.ArgumentParser(prog=f"tauflow-{service}", description=description)
        parser.add_argument("--config", "-c", help="YAML, TOML or JSON config file")
        parser.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override one config key, e.g. --set server.port=0 (repeatable)",
        )
        parser.add_argument("--ready-file", help="write the bound ports here as JSON once serving")
        parser.add_argument(
            "--print-config", action="store_true", help="print the resolved config and exit (its required keys set)"
        )
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
            print(f"tauflow-{service}: {one_line(e)}", file=sys.stderr)
            return 2
        if args.print_config:
            print(config.model_dump_json(indent=2))
            return 0
        setup_logging(service, config.log.level, config.log.format)
        log = logging.getLogger(f"tauflow.{service}")
        exit_when_a_thread_runs_out_of_memory(log)
        serving = False

        def started() -> None:
            nonlocal serving
            serving = True

        try:
            if config.auth.token_file:
                load_run_token(config.auth.token_file)  # (a bad file is a failure to start, naming it)
            setup_telemetry(service, version)  # (OTEL_* variables can be wrong too)
            ready_info: dict[str, Any] = {"service": service, "version": version}
            if config.metrics.enabled:
                ready_info["metrics_port"] = start_metrics_server(config.metrics.host, config.metrics.port)
            asyncio.run(_run(build, config, ready_info, args.ready_file, started))
        except Exception as e:
            if (why := token_refused(e, config.auth.token_file)) is not None:  # an operator's mistake, not a bug
                print(f"tauflow-{service}: {why}", file=sys.stderr)  # (stderr is the service's log too)
                return 1 if serving else 2
            if serving:
                log.exception("service failed")
                return 1
            log.debug("cannot start", exc_info=True)
            print(f"tauflow-{service}: {one_line(e)}", file=sys.stderr)
            return 2
        finally:
            shutdown_telemetry()
        return 0

    return main


def prestart_default_executor(loop: asyncio.AbstractEventLoop) -> ThreadPoolExecutor:
    """The loop's executor (``asyncio.to_thread``'s) with all its threads started now, the size asyncio would
    give it: a thread started later, when memory ran out for a moment (an address-space limit reached), failed
    at its start and the work handed to it never ran, its awaiter waiting for good (a trainer stayed
    CHECKPOINTING, alive, never restarted); and the hook below cannot act then, being short of memory
    itself. Started threads stay, idle, to the end."""
    executor = started_executor(min(32, (os.cpu_count() or 1) + 4), "tauflow-worker")
    loop.set_default_executor(executor)
    return executor


LOST_THREAD_EXIT_CODE = 70  # (EX_SOFTWARE) a restart is the way on


def exit_when_a_thread_runs_out_of_memory(log: logging.Logger) -> None:
    """A thread that runs out of memory ends the process, non-zero, so that its launcher restarts it (and it
    resumes from its checkpoint). A worker thread that could not even start (MemoryError at its bootstrap: an
    address-space limit reached for a moment) was reported by Python as "Exception ignored" and was gone, the
    work handed to it never done: whoever awaited it waited for good (a trainer stayed CHECKPOINTING, alive,
    never restarted, until the run ended "stalled")."""
    unraisable, excepthook = sys.unraisablehook, threading.excepthook

    def lost(where: str) -> None:
        with contextlib.suppress(Exception):  # (logging may need the memory that is missing)
            log.critical("a thread ran out of memory: the service exits to be restarted", extra={"where": where})
        os._exit(LOST_THREAD_EXIT_CODE)

    def on_unraisable(info: Any) -> None:
        # (only a thread that could not start: a finalizer's MemoryError leaves a process that works)
        if isinstance(info.exc_value, MemoryError) and "thread" in str(info.err_msg or ""):
            lost(str(info.err_msg))
        unraisable(info)

    def on_thread_exception(info: threading.ExceptHookArgs) -> None:
        if isinstance(info.exc_value, MemoryError):
            lost(info.thread.name if info.thread is not None else "a thread")
        excepthook(info)

    sys.unraisablehook, threading.excepthook = on_unraisable, on_thread_exception


# Exceptions whose message is the whole story (a file, a port, a value); another type is named, as it is
# likely a bug — unless tauflow defined it (e.g. the queue's WalCorrupt): then it explains itself too.
_SELF_EXPLAINED = (OSError, ValueError)
MAX_LINE_CHARS = 1000


def one_line(error: BaseException) -> str:
    """``error`` as one bounded line: its message, prefixed by its type unless it explains itself."""
    if isinstance(error, OSError) and error.strerror and error.filename is not None:
        text = f"{error.strerror}: {error.filename}"  # not "[Errno 17] File exists: 'x'"
    else:
        text = " ".join(str(error).split())
    explained = isinstance(error, _SELF_EXPLAINED) or type(error).__module__.startswith("tauflow.")
    if not explained or not text:
        text = f"{type(error).__name__}: {text}" if text else type(error).__name__
    if len(text) > MAX_LINE_CHARS:
        text = text[: MAX_LINE_CHARS - 3] + "..."
    return text


def token_refused(error: BaseException, token_file: str) -> str | None:
    """One line, when ``error`` is a peer's UNAUTHENTICATED: this process holds another run's token (or none)."""
    import grpc

    if not (isinstance(error, grpc.RpcError) and callable(getattr(error, "code", None))):
        return None
    if error.code() != grpc.StatusCode.UNAUTHENTICATED:
        return None
    details = error.details() if callable(getattr(error, "details", None)) else ""
    if "is a control method" not in (details or ""):  # (another service's own credentials: not the run token)
        return None
    held = f"auth.token_file {token_file}" if token_file else "no auth.token_file"
    return one_line(ValueError(f"a peer refused this process's run token ({held}): {details}"))


async def _run(build, config, ready_info, ready_file, started) -> None:
    prestart_default_executor(asyncio.get_running_loop())
    app = await build(config)
    await serve(
        app, config.server, ready_info=ready_info, ready_file=ready_file, started=started, run_token=run_token()
    )
