#!/usr/bin/env python
"""Builds ``.gpu-wheels/``: the wheels ``scripts/gpu-check`` installs on a GPU machine that reaches no package
index and has torch, transformers, accelerate and peft (Python 3.12 by default).

It walks the runtime requirements of every tauflow distribution, the trainer's ``megatron`` extra and the test
tools, at the versions installed in this environment, leaves out what the GPU image has and what the GPU
run never imports (``--skip``), and downloads each as a binary wheel for the target Python and platform,
without resolving anything (``pip download --no-deps``): no torch build is ever fetched. Prints the total
size, which must fit what travels with the tree (64 MiB).

    python scripts/gpu_wheels.py                 # -> .gpu-wheels/
    python scripts/gpu_wheels.py --python 3.12 --out .gpu-wheels
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOTS = [
    "tauflow-api", "tauflow-core", "tauflow-media", "tauflow-models", "tauflow-weightsync", "tauflow-queue",
    "tauflow-reward", "tauflow-rollout", "tauflow-trainer", "tauflow-weights", "tauflow-controller",
    "megatron-core", "pytest", "pytest-timeout", "pytest-asyncio",
]  # fmt: skip
# What the GPU image has (torch, transformers, accelerate, peft and what they pull in), or must never be
# replaced from here (a CUDA build of torch and its NVIDIA libraries).
IMAGE_HAS = {
    "torch", "triton", "transformers", "accelerate", "peft", "numpy", "safetensors", "huggingface-hub",
    "hf-xet", "tokenizers", "pyyaml", "requests", "urllib3", "idna", "certifi", "charset-normalizer", "tqdm",
    "regex", "filelock", "fsspec", "jinja2", "markupsafe", "sympy", "mpmath", "networkx", "psutil", "setuptools",
}  # fmt: skip
# (typing-extensions and packaging travel although the image has them: pydantic and anyio need a
# typing-extensions >= 4.16, megatron-core a packaging >= 24.2, and the image's versions are not known)
# Imported lazily, never on the GPU run's path (media decoding, Parquet, Ray): left out to save room.
SKIP = {"av", "pyarrow", "ray"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots: list[str], leave_out: set[str], python: str) -> dict[str, str]:
    """name -> installed version of every runtime requirement reachable from ``roots`` on Linux and ``python``
    (markers evaluated; extras not followed)."""
    from packaging.requirements import Requirement

    environment = {"python_version": python, "python_full_version": f"{python}.0", "sys_platform": "linux",
                   "platform_system": "Linux", "platform_machine": "x86_64", "extra": ""}  # fmt: skip
    seen: dict[str, str] = {}
    todo = list(roots)
    while todo:
        name = canonical(todo.pop())
        if name in seen or name in leave_out:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise SystemExit(f"{name} is not installed here: run scripts/setup first") from None
        seen[name] = dist.version
        for text in dist.requires or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate(environment):
                todo.append(requirement.name)
    return seen


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(".gpu-wheels"))
    p.add_argument("--python", default="3.12", help="the GPU machine's Python (major.minor)")
    p.add_argument("--platform", default="manylinux_2_28_x86_64")
    args = p.parse_args()
    pins = closure(ROOTS, IMAGE_HAS | SKIP, args.python)
    third_party = {n: v for n, v in pins.items() if not n.startswith("tauflow-")}
    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    platforms = [args.platform, "manylinux_2_17_x86_64", "manylinux2014_x86_64", "linux_x86_64"]
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "--python-version", args.python, "-d", str(args.out)]  # fmt: skip
    for platform in platforms:
        command += ["--platform", platform]
    subprocess.run([*command, *(f"{n}=={v}" for n, v in sorted(third_party.items()))], check=True)
    wheels = sorted(args.out.glob("*.whl"))
    total = sum(w.stat().st_size for w in wheels)
    for w in wheels:
        print(f"{w.stat().st_size / 2**20:6.2f} MiB  {w.name}")
    print(f"{len(wheels)} wheels, {total / 2**20:.1f} MiB in {args.out} (for Python {args.python})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
