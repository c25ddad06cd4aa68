"""``tauflow``: the command line. ``tauflow run CONFIG`` trains, with live progress and a summary;
``tauflow scale rollout N``, ``tauflow set max-staleness K`` and ``tauflow status`` change and show a
running run (found by its run directory or its address); ``tauflow trace RUN_DIR_OR_FILE`` turns a run's
spans into its rollout-to-update latency breakdown.

The command wires its run as the service does, through app.build_run: it is the ``tauflow`` program's
wiring, as app.py is ``tauflow-controller``'s."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tauflow.controller.adapters.controller_client import ControlError, ControllerClient, Status, find_run
from tauflow.controller.app import build_run, execute_with_control
from tauflow.controller.config import MAX_ROLLOUT_REPLICAS, RunConfig
from tauflow.controller.launcher import LaunchFailed
from tauflow.controller.ports import PeerError
from tauflow.controller.progress import RunConsole, progress_view
from tauflow.controller.run import MAX_TAU, OutDirInUse, RunStalled
from tauflow.controller.summary import json_text
from tauflow.core.app import one_line
from tauflow.core.config import ConfigError, load_config
from tauflow.core.logs import setup_logging
from tauflow.core.runtoken import TokenFileError

console = RunConsole(stderr=True)  # (a closed pipe quietens it: never SystemExit)


def run_config(args: argparse.Namespace) -> RunConfig:
    """The run's config: the file, ``TAUFLOW_RUN_*``, then the command line (``--set``, ``--resume``,
    ``--launcher``, ``--address``). Raises ConfigError."""
    path = Path(args.config)
    if path.is_dir():
        path = path / "config.yaml"
    overrides = [*args.set, *(["resume=true"] if args.resume else [])]
    if args.launcher:
        overrides.append(f"launcher={args.launcher}")
    if args.address:
        overrides.append(f"ray.address={json.dumps(args.address)}")  # quoted: a string, whatever it looks like
    config = load_config(RunConfig, path=path, env_prefix="TAUFLOW_RUN_", overrides=overrides)
    if args.address and config.launcher != "ray":
        raise ConfigError(
            f"--address is a Ray cluster's address, for --launcher ray (the launcher is {config.launcher})"
        )
    return config


def run_command(args: argparse.Namespace) -> int:
    try:
        config = run_config(args)
    except ConfigError as e:
        console.print(f"[red]tauflow run: {escape(str(e))}")
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        run = build_run(config)  # (writes or reads the run token: out_dir must be writable)
        run.claim_out_dir()  # (a live run there is left alone)
        (run.out_dir / "logs").mkdir(parents=True, exist_ok=True)
    except (OSError, TokenFileError, OutDirInUse) as e:  # (a token file's error names the file, never the token)
        console.print(f"[red]tauflow run: {escape(one_line(e))}")
        return 2
    # (only now: a run that could not be built leaves the process's SIGTERM as it was)
    signal.signal(signal.SIGTERM, _interrupt)  # stop the services on SIGTERM as on Ctrl-C
    setup_logging("controller", "WARNING")
    # A live table on a terminal; plain lines every few seconds elsewhere (a log file shows how far it is).
    try:
        with progress_view(console, run.config, run.progress) as view:
            run.on_progress = view.update
            summary = asyncio.run(execute_with_control(run))
    except (LaunchFailed, RunStalled, PeerError) as e:  # said after the view's last state
        console.print(f"[red]tauflow run: {escape(str(e))}")
        return 1
    except KeyboardInterrupt:
        console.print("[yellow]tauflow run: interrupted; services stopped")
        return 130
    except Exception as e:  # noqa: BLE001 (any other: one line, never a traceback; the services are stopped all the same)
        console.print(f"[red]tauflow run: the run failed: {escape(one_line(e))}; logs in {run.out_dir / 'logs'}")
        return 1
    acc = summary.final_accuracy
    where = (
        f"summary in {run.out_dir}/summary.json and summary.png"
        if run.summary_written
        else f"the summary could NOT be written to {run.out_dir} (the error is above)"
    )
    console.print(
        f"run {config.name}: {len(summary.steps)} steps in {summary.wall_s:.0f}s, final held-out accuracy "
        f"{_percent(acc)}, staleness violations {summary.staleness_violations}; {where}"
    )
    code = _exit_code(summary.status, summary.message, acc, config.target_accuracy)
    return 4 if code == 0 and not run.summary_written else code


def _exit_code(status: str, message: str, acc: float | None, target: float | None) -> int:
    """0 for a run that ended as planned (and reached its target, where it has one); 3 below the target; 130
    for a run stopped before its end (StopRun, as Ctrl-C), whatever its accuracy so far."""
    if status == "interrupted":
        console.print(f"[yellow]tauflow run: {escape(message or 'stopped')}; the run did not reach its end")
        return 130
    if status == "below_target":
        console.print(f"[red]held-out accuracy {_percent(acc)} is below the target {target:.0%}")
        return 3
    if target is not None and acc is not None and acc >= target:
        console.print(f"[green]target reached: {acc:.1%} >= {target:.0%}")
    return 0


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def trace_command(args: argparse.Namespace) -> int:
    from tauflow.controller.tracesummary import NoSpans, summarize_file

    try:
        table = summarize_file(
            args.path, png=Path(args.png) if args.png else None, json_out=Path(args.json) if args.json else None
        )
    except (OSError, NoSpans) as e:
        console.print(f"[red]tauflow trace: {escape(one_line(e) if isinstance(e, OSError) else str(e))}")
        return 2
    print(table)
    return 0


def control_command(args: argparse.Namespace) -> int:
    """``tauflow scale``, ``set``, ``stop`` and ``status`` against a running run."""

    async def call() -> str:
        address, token_file = find_run(args.run or getattr(args, "run_option", None))
        client = ControllerClient(address, args.token_file or token_file)
        try:
            if args.command == "scale":
                previous, replicas = await client.scale_rollout(args.replicas)
                return f"rollout replicas: {previous} -> {replicas} (tauflow status shows them come and go)"
            if args.command == "set":
                previous, tau, version = await client.set_max_staleness(args.value)
                return f"max_staleness: {previous} -> {tau}, in force from policy version {version}"
            if args.command == "stop":
                state = await client.stop_run(args.reason, immediate=args.immediate, grace_s=args.grace)
                return f"run {state}: its services stop after its last step and checkpoint; its summary says why"
            status = await client.status()
            if args.json:
                return json_text({"run": status.run, "services": status.services}, indent=1)
            return status_text(status)
        finally:
            await client.close()

    try:
        print(asyncio.run(call()))
    except ControlError as e:
        console.print(f"[red]tauflow {args.command}: {escape(str(e))}")
        return 1
    return 0


def status_text(status: Status) -> str:
    run = status.run
    head = (
        f"run {run['name']}: {run['state']}, step {run['policy_version']}/{run['total_steps']}, "
        f"max_staleness {run['max_staleness']}, {run['groups_trained']} groups trained, "
        f"{run['staleness_violations']} staleness violations, launcher {run['launcher']}"
    )
    table = Table(show_edge=False, box=None, pad_edge=False)
    for column in ("name", "role", "replica", "address", "health", "restarts", "build", "contracts", "pid"):
        table.add_column(column)
    for svc in status.services:
        contracts = ", ".join(f"{p.split('.')[2]} r{r}" for p, r in sorted(svc["contracts"].items()))
        table.add_row(
            svc["name"],
            svc["role"],
            f"{svc['replica']}/{svc['replicas']}",
            svc["address"],
            svc["health"],
            str(svc["restarts"]),
            svc["build"],
            contracts,
            svc["pid"],
        )
    out = Console(width=200, record=True, file=io.StringIO())
    out.print(table)
    return "\n".join([head, out.export_text().rstrip()])


def _grace_s(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value <= 3600:  # (nan and inf too)
        raise argparse.ArgumentTypeError(f"seconds from 0 to 3600, not {text!r}")
    return value


def _int_between(low: int, high: int) -> Callable[[str], int]:
    """An integer argument within the contract's bounds: one beyond them was a protobuf traceback, exit 1."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"from {low} to {high}, not {text!r}")
        return value

    return parse


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tauflow", description="asynchronous RL post-training for language models")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a training job from a config file (or a recipe folder)")
    run.add_argument("config", help="a run config (YAML/TOML/JSON) or a folder holding config.yaml")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    run.add_argument("--resume", action="store_true", help="continue the run in out_dir from its last checkpoint")
    run.add_argument(
        "--launcher",
        choices=["local", "ray", "external"],
        help="where the services run: local subprocesses (default), actors on a Ray cluster, or "
        "deployed elsewhere (addresses in external.<role>); the config key `launcher`",
    )
    run.add_argument(
        "--address",
        help="the Ray cluster to use with --launcher ray (default auto: RAY_ADDRESS, or the "
        "cluster this machine belongs to); the config key `ray.address`",
    )
    where = (
        "the run: its directory (out_dir) or its ControllerService's host:port; default: the only live run under ./runs"
    )
    token_help = (
        "the run token's file, which scale, set and stop need (default: the one the run directory's "
        "controller.ready.json names; give it with a host:port)"
    )
    scale = sub.add_parser("scale", help="change the number of rollout servers of a running run")
    scale.add_argument("role", choices=["rollout"], help="the role to scale (rollout)")
    scale.add_argument("replicas", type=_int_between(1, MAX_ROLLOUT_REPLICAS), help="rollout servers wanted (1-256)")
    scale.add_argument("--run", help=where)
    scale.add_argument("--token-file", help=token_help)
    set_ = sub.add_parser("set", help="change a running run's staleness bound tau")
    set_.add_argument("key", choices=["max-staleness"], help="what to set (max-staleness: tau)")
    set_.add_argument("value", type=_int_between(-1, MAX_TAU), help="0 on-policy, N bounded, -1 unbounded")
    set_.add_argument("--run", help=where)
    set_.add_argument("--token-file", help=token_help)
    stop = sub.add_parser("stop", help="stop a running run: its last step and checkpoint, then every service")
    stop.add_argument("run", nargs="?", help=where)
    stop.add_argument("--run", dest="run_option", metavar="RUN", help="the same, as scale and set take it")
    stop.add_argument("--reason", default="tauflow stop", help="why, recorded in the summary")
    stop.add_argument("--immediate", action="store_true", help="at once: no final step, no checkpoint")
    stop.add_argument("--grace", type=_grace_s, metavar="S", help="seconds a graceful stop may take (at most 3600)")
    stop.add_argument("--token-file", help=token_help)
    status = sub.add_parser("status", help="a running run's progress and every process of every role")
    status.add_argument("run", nargs="?", help=where)
    status.add_argument("--run", dest="run_option", metavar="RUN", help="the same, as scale and set take it")
    status.add_argument("--json", action="store_true", help="as JSON")
    status.add_argument("--token-file", help=token_help)
    trace = sub.add_parser("trace", help="a run's spans as the rollout-to-update latency breakdown (table and PNG)")
    trace.add_argument("path", help="a run folder (its traces.jsonl) or a span file written with traces_file")
    trace.add_argument("--png", help="where the chart goes (default: traces.png beside the span file)")
    trace.add_argument("--json", help="also write the per-group records and the statistics here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.captureWarnings(True)
    if args.command == "run":
        return run_command(args)
    if args.command == "trace":
        return trace_command(args)
    if args.command in ("scale", "set", "stop", "status"):
        return control_command(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
