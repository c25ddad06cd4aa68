#!/usr/bin/env python
"""What ``scripts/gpu-check`` runs (see there): the environment, the ``gpu`` tests, the GRPO benchmark; one JSON.

Each part runs in its own process under a time limit taken from ``--budget-s``, so that a hang in one still
leaves the others' figures in ``<out>/gpu-check.json``. Exits non-zero when a gpu test failed or a part did
not finish.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GPU_TESTS = [
    "services/rollout/tests/test_cuda.py",
    "services/trainer/tests/test_backend.py",
    "services/trainer/tests/test_megatron_backend.py",
    "services/trainer/tests/test_megatron_convert.py",
    "services/trainer/tests/test_parallel.py",
    "libs/weightsync/tests/test_ipc.py",
    "libs/models/tests/test_offload.py",
    "tests/integration/test_colocated_weights.py",
]


def environment() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}  # fmt: skip
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1), gpus=torch.cuda.device_count())
    shm = os.statvfs("/dev/shm") if os.path.isdir("/dev/shm") else None
    info["dev_shm_free_gib"] = round(shm.f_bavail * shm.f_frsize / 2**30, 2) if shm else None
    for module in ("transformers", "megatron.core", "grpc"):
        try:
            info[module] = getattr(__import__(module, fromlist=["__version__"]), "__version__", "?")
        except ImportError as e:
            info[module] = f"missing: {e}"
    return info


def run(command: list[str], log: Path, timeout_s: float) -> dict[str, Any]:
    started = time.perf_counter()
    with log.open("wb") as out:
        try:
            rc: int | str = subprocess.run(
                command, check=False, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s
            ).returncode
        except subprocess.TimeoutExpired:
            rc = f"timed out after {timeout_s:.0f} s"
    tail = log.read_text(errors="replace").splitlines()[-15:]
    return {"returncode": rc, "seconds": round(time.perf_counter() - started, 1), "log_tail": tail}


def gpu_tests(out: Path, timeout_s: float) -> dict[str, Any]:
    junit = out / "gpu-tests.xml"
    result = run([sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", "-o", "addopts=",
                  "--import-mode=importlib", f"--junitxml={junit}", "-q", *GPU_TESTS], out / "gpu-tests.log", timeout_s)  # fmt: skip
    cases: dict[str, str] = {}
    if junit.exists():
        for case in ET.parse(junit).getroot().iter("testcase"):
            outcome = "passed"
            for kind in ("failure", "error", "skipped"):
                node = case.find(kind)
                if node is not None:
                    outcome = f"{kind}: {(node.get('message') or '')[:300]}"
            cases[f"{case.get('classname')}::{case.get('name')}"] = outcome
    result["tests"] = cases
    result["passed"] = sum(v == "passed" for v in cases.values())
    result["not_passed"] = sum(v != "passed" for v in cases.values())
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "gpu-check")
    p.add_argument("--budget-s", type=float, default=450.0, help="the whole check's time (tests 35 %%, GRPO the rest)")
    p.add_argument("--bench-args", default="--colocated-services", help="extra arguments of bench/gpu_grpo.py")
    args = p.parse_args()
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
    report["gpu_tests"] = gpu_tests(args.out, 0.35 * args.budget_s)
    save()
    left = args.budget_s - (time.perf_counter() - started) - 10
    bench = args.out / "grpo"
    report["grpo"] = run([sys.executable, "bench/gpu_grpo.py", "--out", str(bench), *args.bench_args.split()],
                         args.out / "grpo.log", max(left, 60))  # fmt: skip
    if (bench / "gpu_grpo.json").exists():
        report["grpo"]["figures"] = json.loads((bench / "gpu_grpo.json").read_text())
    save()
    print(json.dumps(report, indent=2))
    ok = (
        report["gpu_tests"]["not_passed"] == 0
        and report["gpu_tests"]["passed"] > 0
        and report["grpo"]["returncode"] == 0
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
