#!/usr/bin/env python
"""What ``scripts/gpu-check`` runs (see there): the environment, the ``gpu`` tests, the GRPO benchmark; one JSON.

Each part runs in its own process group under a time limit taken from ``--budget-s``, so that a hang in one
still leaves the others' figures in ``<out>/gpu-check.json``; at its limit a part is interrupted (pytest then
writes the results of the tests that ran) and whatever it started is killed. ``<out>`` receives small files
only (the JSONs, the junit file, the two logs' tails): the benchmark's models, runs and checkpoints (GBs) go
to a scratch folder, since a device machine returns a few MiB. Exits non-zero when a gpu test failed or a part
did not finish.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# Every file holding a test marked gpu (a CPU test keeps this list equal to them).
GPU_TESTS = [
    "services/rollout/tests/test_cuda.py",
    "services/trainer/tests/test_backend.py",
    "services/trainer/tests/test_batch.py",
    "services/trainer/tests/test_megatron_backend.py",
    "services/trainer/tests/test_parallel.py",
    "libs/weightsync/tests/test_ipc.py",
    "libs/models/tests/test_offload.py",
    "tests/integration/test_colocated_weights.py",
]


def _environment() -> dict[str, Any]:
    """Run in a child process (``--environment``): a CUDA context held by this process for the whole check
    would count in the benchmark's device-wide memory figures."""
    import torch

    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}  # fmt: skip
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1), gpus=torch.cuda.device_count())
        with contextlib.suppress(Exception):
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    shm = os.statvfs("/dev/shm") if os.path.isdir("/dev/shm") else None
    info["dev_shm_free_gib"] = round(shm.f_bavail * shm.f_frsize / 2**30, 2) if shm else None
    for module in ("transformers", "megatron.core", "grpc", "pydantic", "pytest", "typing_extensions", "packaging"):
        try:
            version = getattr(__import__(module, fromlist=["__version__"]), "__version__", None)
            info[module] = version or metadata.version(module.replace(".", "-").replace("_", "-"))
        except (ImportError, metadata.PackageNotFoundError) as e:
            info[module] = f"missing: {e}"
    info["PYTORCH_CUDA_ALLOC_CONF"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    return info


def environment() -> dict[str, Any]:
    try:
        done = subprocess.run([sys.executable, __file__, "--environment"], check=True, capture_output=True,
                              text=True, timeout=120, cwd=ROOT)  # fmt: skip
        return dict(json.loads(done.stdout.strip().splitlines()[-1]))
    except (subprocess.SubprocessError, ValueError, IndexError) as e:
        return {"error": f"{type(e).__name__}: {e}"[:500]}


LOG_KEEP_BYTES = 4 * 2**20  # a device machine returns files of a few MiB: each log keeps its last 4 MiB
INTERRUPT_GRACE_S = 20.0  # after the SIGINT at a part's limit, before the kill


def run(command: list[str], log: Path, timeout_s: float) -> dict[str, Any]:
    """``command`` in a process group of its own: at ``timeout_s`` it is interrupted (SIGINT: pytest still
    writes the junit of the tests that ran, the benchmark its figures so far), then the group is killed, so
    that no rank, service or child it started outlives its part and holds the GPU in the next."""
    started = time.perf_counter()
    with log.open("wb") as out:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc: int | str = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=INTERRUPT_GRACE_S)
            rc = f"timed out after {timeout_s:.0f} s"
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
    text = log.read_bytes()
    if len(text) > LOG_KEEP_BYTES:
        log.write_bytes(b"[... cut: the last 4 MiB follow]\n" + text[-LOG_KEEP_BYTES:])
    tail = text.decode(errors="replace").splitlines()[-15:]
    return {"returncode": rc, "seconds": round(time.perf_counter() - started, 1), "log_tail": tail}


def junit_outcomes(junit: Path) -> dict[str, str]:
    """Each test's outcome from pytest's junit file: ``passed``, or the kind and message of what went wrong.
    A test a SIGINT interrupted is listed by pytest without a name: an error, not a pass."""
    cases: dict[str, str] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        if case.get("name") is None:
            cases["(interrupted)"] = "error: interrupted at the part's time limit"
            continue
        outcome = "passed"
        for kind in ("failure", "error", "skipped"):
            node = case.find(kind)
            if node is not None:
                outcome = f"{kind}: {(node.get('message') or '')[:300]}"
        cases[f"{case.get('classname')}::{case.get('name')}"] = outcome
    return cases


def gpu_tests(out: Path, timeout_s: float) -> dict[str, Any]:
    junit = out / "gpu-tests.xml"
    # The machine's own pytest plugins (cov, xdist, benchmark, mock...) are built for its pytest, not for the
    # one shipped in .gpu-wheels: none is loaded, only those the suites use. A test that hangs ends at 90 s.
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    result = run([sys.executable, "-m", "pytest", "-p", "asyncio", "-p", "timeout", "--timeout=90", "-m", "gpu",
                  "--durations=0", "-p", "no:cacheprovider", "-o", "addopts=", "--import-mode=importlib",
                  f"--junitxml={junit}", "-q", *GPU_TESTS], out / "gpu-tests.log", timeout_s)  # fmt: skip
    os.environ.pop("PYTEST_DISABLE_PLUGIN_AUTOLOAD")
    try:
        cases = junit_outcomes(junit) if junit.exists() else {}
    except ET.ParseError as e:  # (a junit file cut short)
        cases = {"(junit)": f"error: {junit.name} unreadable: {e}"}
    result["tests"] = cases
    result["passed"] = sum(v == "passed" for v in cases.values())
    result["not_passed"] = sum(v != "passed" for v in cases.values())
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "gpu-check")
    p.add_argument("--budget-s", type=float, default=450.0, help="the whole check's time (tests 40 %%, GRPO the rest)")
    # (20 steps, 3 of them warm-up, and a warm start of at most 45 s: the three paths fit the budget's GRPO part)
    p.add_argument("--bench-args", default="--colocated-services --sft-max-s 45 --steps 20 --skip 3",
                   help="arguments of bench/gpu_grpo.py")  # fmt: skip
    p.add_argument("--scratch", type=Path, default=Path(tempfile.gettempdir()) / "tauflow-gpu-check",
                   help="the benchmark's models, runs and checkpoints (GBs; never under --out)")  # fmt: skip
    p.add_argument("--environment", action="store_true", help=argparse.SUPPRESS)  # (environment()'s child)
    args = p.parse_args()
    # A check started with SIGINT ignored (a backgrounded script) would pass that on to its parts: pytest,
    # killed then, writes no junit. A handler here is reset to the default in each part at its exec.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if args.environment:
        print(json.dumps(_environment()))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "environment": environment()}
    path = args.out / "gpu-check.json"

    def save() -> None:
        report["seconds"] = round(time.perf_counter() - started, 1)
        path.write_text(json.dumps(report, indent=2))

    if (report["environment"]["dev_shm_free_gib"] or 0) < 8:
        # a container's /dev/shm (Docker's default: 64 MB) cannot hold a staged version: stage on disk
        staging = Path(tempfile.gettempdir()) / "tauflow-staging"
        staging.mkdir(exist_ok=True)
        os.environ["TAUFLOW_STAGING_DIR"] = report["environment"]["staging_dir"] = str(staging)
    report["gpu_tests"] = gpu_tests(args.out, 0.4 * args.budget_s)
    save()
    left = args.budget_s - (time.perf_counter() - started) - 10
    bench = args.scratch / "grpo"
    report["grpo"] = run([sys.executable, "bench/gpu_grpo.py", "--out", str(bench), *args.bench_args.split()],
                         args.out / "grpo.log", max(left, 60))  # fmt: skip
    if (bench / "gpu_grpo.json").exists():
        report["grpo"]["figures"] = json.loads((bench / "gpu_grpo.json").read_text())
        shutil.copy(bench / "gpu_grpo.json", args.out / "gpu_grpo.json")
    save()
    print(json.dumps(report, indent=2))
    ok = (
        report["gpu_tests"]["returncode"] == 0
        and report["gpu_tests"]["not_passed"] == 0
        and report["gpu_tests"]["passed"] > 0
        and report["grpo"]["returncode"] == 0
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
