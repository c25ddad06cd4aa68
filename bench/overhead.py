#!/usr/bin/env python
"""What the services cost at τ = 0 against the same RL loop in one process: the step-time ratio (issue #17).

The same recipe (default: the embedded examples/addition, its prepared warm start, sampler settings, GRPO
loss, optimizer and schedule, seed) runs twice per round:

- **in-process baseline**: one Python process calls the rollout engine (HFEngine), the reward function
  and the trainer backend (TorchBackend) directly and on-policy: generate a step's 64 groups of 8 with the
  current weights, score them, one ``train_step``, copy the new weights into the engine, next step. No
  gRPC, no queue, no sidecar, no checkpoints. The engine's, the trainer's and the reward's settings are
  derived from the run config by the controller's own ``Run._settings`` and loaded into the services'
  config classes, as each service loads its ``--set`` settings: nothing is copied by hand.
- **services at τ = 0**: a normal ``tauflow run`` of the recipe with ``max_staleness=0``, no evaluation,
  every service its own process (one thread each). Its step time is the interval between two commits of
  the trainer (``committed_s``); the services' CPU per step and role is sampled from /proc/<pid>/stat
  (bench/tracing_overhead.py's ``ServiceCpu``), and the trainer's own wait / train / publish per step is
  read from the run's summary.

The first ``--skip`` steps of each are left out (warm-up). With several ``--rounds`` the order alternates
(baseline first, then services first, ...) and the ratio is the median of each round's services/baseline.
Target (issue #17): **services / in-process ≤ 1.15**.

    python bench/overhead.py                      # one round of 60 steps each
    python bench/overhead.py --steps 20 --skip 3  # a quick check
    python bench/overhead.py --rounds 2 --steps 60

Prints a table and ``BENCH_JSON {...}``. See bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ADDITION = ROOT / "examples" / "addition"
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the other bench scripts' helpers

from tracing_overhead import ServiceCpu  # (after the path: bench/ is not a package)


def machine_busy_s() -> float:
    """CPU seconds every process on the machine has used since boot (/proc/stat): the work of others on the
    same cores shows as this minus the benchmark's own CPU."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def prepare(out: Path) -> Path:
    if not (out / "model").exists():
        subprocess.run([sys.executable, str(ADDITION / "prepare.py"), "--out", str(out)], check=True, cwd=ROOT)
    return out


def run_config(recipe: Path, prepared: Path, out: Path, steps: int, extra: list[str]) -> Any:
    """The recipe at τ = 0 without evaluation or preparation: what both paths run."""
    from tauflow.controller.config import RunConfig
    from tauflow.core.config import load_config

    overrides = [
        "prepare=[]", f"out_dir={out}", f"model={prepared / 'model'}", f"dataset={prepared / 'train.jsonl'}",
        "eval.dataset=", "target_accuracy=null", f"steps={steps}", "max_staleness=0", *extra,
    ]  # fmt: skip
    return load_config(RunConfig, path=recipe, env_prefix="TAUFLOW_RUN_", overrides=overrides)


def service_config(run: Any, role: str, config_cls: type) -> Any:
    """``role``'s typed config exactly as its process would load it: the controller's settings for the role
    (run config + ``services.<role>``), written as the launcher's settings file, read back by the
    services' loader (with its environment prefix)."""
    from tauflow.controller.launcher import write_settings
    from tauflow.core.config import load_config

    with tempfile.TemporaryDirectory() as folder:
        settings_file = Path(folder) / f"{role}.json"
        write_settings(settings_file, run._settings(role, {}))  # the file the launcher gives the process
        return load_config(config_cls, path=settings_file, env_prefix=f"TAUFLOW_{role.upper()}_")


# -- the in-process baseline ---------------------------------------------------------------------------


class InProcessLoop:
    """The rollout, reward and trainer of a run, called directly in this process, on-policy."""

    def __init__(self, run: Any) -> None:
        import torch

        from tauflow.reward.config import RewardConfig
        from tauflow.reward.registry import build_registry
        from tauflow.rollout.config import RolloutConfig
        from tauflow.rollout.dataset import epochs, load_prompts
        from tauflow.rollout.engine import engine_class
        from tauflow.rollout.producer import sampling_params
        from tauflow.rollout.text import TextCodec
        from tauflow.trainer.backend import TorchBackend
        from tauflow.trainer.config import TrainerConfig

        torch.set_num_threads(1)  # as each service process runs (OMP_NUM_THREADS=1)
        self.trainer_config = service_config(run, "trainer", TrainerConfig)
        self.rollout_config = rollout = service_config(run, "rollout", RolloutConfig)
        reward_config = service_config(run, "reward", RewardConfig)

        # The engine as the rollout service builds it (rollout/app.py: build).
        self.codec = TextCodec.from_folder(rollout.model_path)
        eos = self.codec.eos_token_id if self.codec is not None else None
        self.engine = engine_class(rollout.engine).from_pretrained(
            rollout.model_path,
            engine_id=f"{rollout.server_id}-{rollout.engine}",
            seed=rollout.seed,
            **({"detokenize": self.codec.decode} if self.codec is not None else {}),
            **({"extra_eos_token_ids": (eos,)} if eos is not None else {}),
            **rollout.engine_options,
        )
        self.sampling = sampling_params(rollout.sampling, n=rollout.group_size)
        self.prompts = epochs(load_prompts(rollout.dataset, self.codec, rollout.data.model_dump()), rollout.seed)

        # The reward function the reward service would call for the rollout's requests, with its config.
        registry = build_registry(reward_config)
        self.reward_fn = registry.get(rollout.reward_fn or registry.default_name)
        self.reward_fn_config = self.reward_fn.resolve_config({})

        self.backend = TorchBackend(self.trainer_config.backend)
        self.groups_per_step = self.trainer_config.groups_per_step
        self.max_staleness = self.trainer_config.max_staleness

    def step(self, index: int) -> dict[str, float]:
        """One on-policy step; the wall time of each phase and the step's mean reward."""
        t0 = time.perf_counter()
        prompts = [next(self.prompts) for _ in range(self.groups_per_step)]
        completions = self.engine.submit([p.token_ids for p in prompts], self.sampling).result()
        t1 = time.perf_counter()
        rewards = self._score(index, prompts, completions)
        t2 = time.perf_counter()
        result = self.backend.train_step(
            self._groups(index, prompts, completions, rewards), max_staleness=self.max_staleness
        )
        if not result.committed:
            raise RuntimeError(f"step {index} did not commit: {result.metrics}")
        t3 = time.perf_counter()
        # The publish: the trainer's live weights (aliases), copied into the engine, swapped in before the
        # next generation (the future resolves once the engine serves the version).
        self.engine.stage_weights(self.backend.version, self.backend.state_dict_for_publish()).result()
        t4 = time.perf_counter()
        flat = [r for group in rewards for r in group]
        return {
            "trained_tokens": float(result.trained_tokens),
            "generated_tokens": float(sum(len(c.token_ids) for group in completions for c in group)),
            "generate_s": t1 - t0,
            "reward_s": t2 - t1,
            "train_s": t3 - t2,
            "weights_s": t4 - t3,
            "step_s": t4 - t0,
            "mean_reward": sum(flat) / len(flat),
        }

    def _score(self, index: int, prompts: list[Any], completions: list[list[Any]]) -> list[list[float]]:
        """What the producer sends and the reward service decodes (the decoded completion, the prompt's
        metadata, the finish reason), scored by the same function object, inline as the service runs it."""
        from tauflow.reward.api import GroupInput, SampleInput
        from tauflow.reward.config import Executor
        from tauflow.reward.runner import Scorer
        from tauflow.rollout.engine.base import FinishReason

        if self.reward_fn.executor is not Executor.INLINE:
            raise RuntimeError(f"reward function {self.reward_fn.name!r} runs in a pool; only inline is measured")
        finish = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort"}
        decode = self.codec.decode if self.codec is not None else (lambda ids: "")
        groups = []
        for g, (prompt, group) in enumerate(zip(prompts, completions, strict=True)):
            group_id = f"inproc-{index}-{g}"
            samples = tuple(
                SampleInput(
                    sample_id=str(i),
                    completion_text=decode(c.token_ids),
                    group_metadata=prompt.metadata,
                    group_id=group_id,
                    prompt_id=prompt.prompt_id,
                    finish_reason=finish[c.finish_reason],
                )
                for i, c in enumerate(group)
            )
            groups.append(GroupInput(group_id, prompt.prompt_id, samples, prompt.metadata))
        results = Scorer._inline(self.reward_fn, groups, self.reward_fn_config)
        return [[r.score for r in group] for group in results]

    def _groups(
        self, index: int, prompts: list[Any], completions: list[list[Any]], rewards: list[list[float]]
    ) -> list[Any]:
        """The trainer's groups, as it decodes them from the queue (trainer/adapters/convert.py)."""
        from tauflow.rollout.engine.base import FinishReason
        from tauflow.trainer.batch import Group, Sample

        return [
            Group(f"inproc-{index}-{g}", [
                Sample(prompt_ids=list(prompt.token_ids), completion_ids=list(c.token_ids),
                       behaviour_logprobs=list(c.logprobs), reward=r, versions=list(c.versions) or None,
                       behaviour_version=c.behaviour_version or 0, sample_id=str(i),
                       truncated=c.finish_reason == FinishReason.LENGTH)
                for i, (c, r) in enumerate(zip(group, group_rewards, strict=True))
            ])
            for g, (prompt, group, group_rewards) in enumerate(zip(prompts, completions, rewards, strict=True))
        ]  # fmt: skip

    def close(self) -> None:
        self.engine.close()
        self.backend.close()


def in_process(config: Any, steps: int, skip: int) -> dict[str, Any]:
    from tauflow.controller.app import build_run

    loop = InProcessLoop(build_run(config))  # (a run object only for its settings: nothing is started)
    records = []
    try:
        for index in range(steps):
            if index == skip:
                cpu0, busy0, wall0 = time.process_time(), machine_busy_s(), time.perf_counter()
            records.append(loop.step(index))
        cpu, busy, wall = time.process_time() - cpu0, machine_busy_s() - busy0, time.perf_counter() - wall0
    finally:
        loop.close()
    measured = records[skip:]

    def median(key: str) -> float:
        return statistics.median(r[key] for r in measured)

    return {
        "steps": len(records), "measured_steps": len(measured), "step_s": median("step_s"),
        "generate_s": median("generate_s"), "reward_s": median("reward_s"), "train_s": median("train_s"),
        "weights_s": median("weights_s"), "cpu_per_step_s": cpu / max(1, len(measured)),
        "trained_tokens_per_step": statistics.mean(r["trained_tokens"] for r in measured),
        "generated_tokens_per_step": statistics.mean(r["generated_tokens"] for r in measured),
        "other_cores": (busy - cpu) / wall,  # cores other processes kept busy meanwhile (0 on an idle machine)
        "mean_reward": [r["mean_reward"] for r in records],
    }  # fmt: skip


# -- the services at τ = 0 -----------------------------------------------------------------------------


def services(config: Any, skip: int) -> dict[str, Any]:
    from tauflow.controller.app import build_run  # the run wired with its launcher and gRPC clients

    run = build_run(config)
    cpu = ServiceCpu(config.run_dir)
    busy0, wall0, own0 = machine_busy_s(), time.perf_counter(), time.process_time()
    try:
        summary = asyncio.run(run.execute()).to_json()
    finally:
        cpu.stop()
    busy, wall, own = machine_busy_s() - busy0, time.perf_counter() - wall0, time.process_time() - own0
    # every service process's CPU (start-up included; the controller is this process, counted by `own`)
    services_cpu = sum(v for role, v in cpu.samples[-1][1].items() if role != "controller") if cpu.samples else 0.0
    measured = summary["steps"][skip:]
    if len(measured) < 2:
        raise RuntimeError(f"the run committed {len(summary['steps'])} steps, too few past --skip {skip}")
    commits = [s["committed_s"] for s in measured]
    first, last = cpu.at(run._wall0 + commits[0]), cpu.at(run._wall0 + commits[-1])
    by_role = {role: (last[role] - first.get(role, 0.0)) / (len(commits) - 1) for role in sorted(last)}

    def median(key: str) -> float:
        values = [s["metrics"][key] for s in measured if key in s["metrics"]]
        return statistics.median(values) if values else float("nan")

    return {
        "steps": len(summary["steps"]), "measured_steps": len(measured),
        "step_s": statistics.median(b - a for a, b in itertools.pairwise(commits)),
        "wait_s": median("time/wait_s"), "train_s": median("time/train_s"), "publish_s": median("time/publish_s"),
        "cpu_per_step_by_role_s": by_role, "cpu_per_step_s": sum(by_role.values()),
        "other_cores": (busy - services_cpu - own) / wall,  # cores other processes kept busy over the run
        "staleness_violations": summary["staleness_violations"],
        "trained_tokens_per_step": statistics.mean(s["trained_tokens"] for s in measured),
        "mean_reward": [s["mean_reward"] for s in summary["steps"]],
    }  # fmt: skip


# -- main ----------------------------------------------------------------------------------------------


def ms(seconds: float) -> str:
    return f"{seconds * 1000:7.1f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", type=Path, default=ADDITION / "config.yaml")
    p.add_argument(
        "--prepared",
        type=Path,
        default=ROOT / "runs/addition/prepared",
        help="the recipe's prepared model and data (made with examples/addition/prepare.py if missing)",
    )
    p.add_argument("--steps", type=int, default=60, help="steps of each path")
    p.add_argument("--skip", type=int, default=5, help="first steps of each path left out (warm-up)")
    p.add_argument("--rounds", type=int, default=1, help="(baseline, services) pairs, the order alternating")
    p.add_argument("--out", type=Path, default=None, help="run folders (default: a temporary folder)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="recipe override for both paths")
    args = p.parse_args()
    if args.steps < args.skip + 3:
        p.error("--steps must exceed --skip by 3 at least")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # (the services inherit it)
    prepared = prepare(args.prepared)
    out = args.out or Path(tempfile.mkdtemp(prefix="tauflow-bench-overhead-"))

    rounds = []
    for r in range(args.rounds):
        result: dict[str, Any] = {}
        for path in ("in_process", "services") if r % 2 == 0 else ("services", "in_process"):
            config = run_config(args.recipe, prepared, out / f"{path}{r}", args.steps, args.set)
            result[path] = (
                in_process(config, args.steps, args.skip) if path == "in_process" else (services(config, args.skip))
            )
            print(f"round {r} {path:10}: step {ms(result[path]['step_s'])} ms", flush=True)
        result["ratio"] = result["services"]["step_s"] / result["in_process"]["step_s"]
        result["cpu_ratio"] = result["services"]["cpu_per_step_s"] / result["in_process"]["cpu_per_step_s"]
        rounds.append(result)

    ratio = statistics.median(r["ratio"] for r in rounds)
    cpu_ratio = statistics.median(r["cpu_ratio"] for r in rounds)
    print(f"\n{args.steps} steps each, the first {args.skip} left out; medians, ms per step")
    print(f"{'round':>5} {'path':<12} {'step':>7} {'CPU':>7} {'others':>6}   split")
    for r, result in enumerate(rounds):
        base, svc = result["in_process"], result["services"]
        print(
            f"{r:>5} {'in-process':<12} {ms(base['step_s'])} {ms(base['cpu_per_step_s'])} {base['other_cores']:6.2f}"
            f"   generate {ms(base['generate_s'])}, reward {ms(base['reward_s'])}, train {ms(base['train_s'])}, "
            f"weight copy {ms(base['weights_s'])}"
        )
        print(
            f"{r:>5} {'services':<12} {ms(svc['step_s'])} {ms(svc['cpu_per_step_s'])} {svc['other_cores']:6.2f}"
            f"   trainer: wait {ms(svc['wait_s'])}, train {ms(svc['train_s'])}, publish {ms(svc['publish_s'])}"
        )
    roles = sorted({role for r in rounds for role in r["services"]["cpu_per_step_by_role_s"]})
    by_role = {
        role: statistics.median(r["services"]["cpu_per_step_by_role_s"].get(role, 0.0) for r in rounds)
        for role in roles
    }
    print(
        "services' CPU per step by role (median of rounds): "
        + ", ".join(f"{k} {ms(v).strip()}" for k, v in by_role.items())
    )
    print("(CPU: the path's CPU per step, every service process together; others: cores other processes on the")
    print(" machine kept busy meanwhile; controller: this process while it follows the run)")
    print(
        f"step-time ratio services / in-process per round: {' '.join(format(r['ratio'], '.3f') for r in rounds)}; "
        f"median {ratio:.3f} (target <= 1.15: {'met' if ratio <= 1.15 else 'MISSED'})"
    )
    print(f"CPU per step ratio: {' '.join(format(r['cpu_ratio'], '.3f') for r in rounds)}; median {cpu_ratio:.3f}")
    base, svc = rounds[-1]["in_process"], rounds[-1]["services"]
    print(
        f"mean reward, first and last 5 steps (last round): in-process {statistics.mean(base['mean_reward'][:5]):.3f}"
        f" -> {statistics.mean(base['mean_reward'][-5:]):.3f}, services {statistics.mean(svc['mean_reward'][:5]):.3f}"
        f" -> {statistics.mean(svc['mean_reward'][-5:]):.3f}"
    )
    report = {
        "steps": args.steps,
        "skip": args.skip,
        "rounds": rounds,
        "ratio": ratio,
        "cpu_ratio": cpu_ratio,
        "cpu_per_step_by_role_s": by_role,
        "target": 1.15,
        "out": str(out),
    }
    print("BENCH_JSON " + json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
