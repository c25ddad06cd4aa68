#!/usr/bin/env python
"""GRPO on one GPU: the addition task scaled up to a Qwen2.5-0.5B-shaped model, colocated against
disaggregated (issue #18, run by scripts/gpu-check; docs/gpu.md).

- **model**: Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 query heads, 2 key/value heads, MLP 4864) built
  from a config over the addition task's 16-token vocabulary (so 0.36 B parameters: the real model's 136 M
  embedding rows would never be sampled here), random init, then a supervised warm start on the trainer
  backend (to ``--sft-target`` greedy accuracy, at most ``--sft-max-s``) so that GRPO has rewards to learn from.
- **colocated, τ = 0**: trainer and engine in one process on the GPU taking turns: generate a step's groups,
  score, one ``train_step``, copy the new weights into the engine in GPU memory, next step
  (bench/overhead.py's in-process loop; no gRPC, queue or sidecar).
- **disaggregated, τ = 1**: ``tauflow run`` with every role its own process, trainer and rollout on the same
  GPU, the queue letting the rollout generate one version ahead; weights through the sidecar (gloo).
- **colocated services, τ = 0** (``--colocated-services``, last): every role its own process on the GPU,
  taking turns: the sidecar's ``ipc`` backend (the trainer's weights read by the engine through CUDA IPC),
  the trainer's weights and optimizer state offloaded between its steps, the idle engine's weights offloaded
  and its cached memory released.

Reported per path: median step time, trained and generated tokens per second, weight-update time
(``weights_update_measures`` says what: in the process, the copy into the engine and its swap; as services,
the trainer's publish, the engines loading after it), mean reward per step, and GPU memory high-water marks
per role (each process's PyTorch allocator peak, from its metrics; these peaks are not simultaneous, most of
all when the roles take turns) and the device's (nvidia-smi, every process on the GPU, also as its rise over
the path's start). The headline speedup is like for like: services at τ = 1 against services colocated at
τ = 0 (``--colocated-services``); the in-process loop against τ = 1 also mixes in the cost of the services.
With the task's 4-token answers generation is a small part of a step, so there is little to overlap: expect
less than the generation-bound figures of Relax (1.76×) and AReaL (2.77×).

    python bench/gpu_grpo.py --out runs/gpu-grpo                            # on a GPU
    python bench/gpu_grpo.py --device cpu --shape tiny --steps 4 --skip 1 --groups 8 --sft-max-s 20  # CPU smoke

Prints ``BENCH_JSON {...}`` and writes it to ``<out>/gpu_grpo.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ADDITION = ROOT / "examples" / "addition"
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the other bench scripts' helpers
sys.path.insert(0, str(ADDITION))

import task  # the addition task: tokenizer, problems, prompts  (after the paths)
from overhead import in_process, run_config, services
from prepare import greedy_accuracy  # examples/addition/prepare.py: the warm start's own measure

PUBLISH_MEASURES = "the trainer's publish (its weights to the sidecar); the engines load them after it"
SHAPES = {
    # Qwen2.5-0.5B's decoder (its config.json), over the task's vocabulary
    "qwen2.5-0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                     "num_attention_heads": 14, "num_key_value_heads": 2},
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2},
}  # fmt: skip


class GpuMemory:
    """GPU memory high-water marks, sampled every second: each service's own (its
    ``tauflow_process_cuda_memory_peak_bytes``, scraped from the metrics port its ready file names; this
    process's read directly, as ``own_role``) and the device's (nvidia-smi's memory.used: every process on the
    GPU). Per-process figures come from the processes themselves, so they hold inside a container too, where
    nvidia-smi lists the host's pids."""

    def __init__(self, run_dir: Path | None, own_role: str) -> None:
        self.run_dir, self.own_role = run_dir, own_role
        self.peak_mib: dict[str, float] = {}
        self._device_start_mib = self._device_used_mib()  # (what was on the GPU before this path)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _note(self, role: str, mib: float) -> None:
        self.peak_mib[role] = max(self.peak_mib.get(role, 0.0), mib)

    def _sample(self) -> None:
        from tauflow.core.metrics import cuda_memory_peak_bytes

        self._note(self.own_role, cuda_memory_peak_bytes() / 2**20)
        for ready in self.run_dir.glob("*.ready.json") if self.run_dir and self.run_dir.exists() else []:
            try:
                port = json.loads(ready.read_text())["metrics_port"]
                body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
            except (OSError, ValueError, KeyError):
                continue  # not serving yet, or gone
            for line in body.splitlines():
                if line.startswith("tauflow_process_cuda_memory_peak_bytes "):
                    self._note(ready.name.split(".")[0], float(line.split()[1]) / 2**20)
        used = self._device_used_mib()
        if used is not None:
            self._note("device (nvidia-smi)", used)

    @staticmethod
    def _device_used_mib() -> float | None:
        if not shutil.which("nvidia-smi"):
            return None
        query = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "--id=0"]
        try:
            used = subprocess.run(query, check=False, capture_output=True, text=True, timeout=10).stdout.strip()
            return float(used.splitlines()[0])
        except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
            return None

    def _loop(self) -> None:
        while not self._stop.wait(1.0):
            self._sample()

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        self._sample()
        peaks = {role: round(mib, 1) for role, mib in self.peak_mib.items() if mib > 0}
        if self._device_start_mib is not None and "device (nvidia-smi)" in peaks:
            peaks["device (nvidia-smi) over the path's start"] = round(
                peaks["device (nvidia-smi)"] - self._device_start_mib, 1
            )
        return peaks


def prepare(out: Path, shape: str, device: str, target: float, max_s: float, seed: int) -> dict[str, Any]:
    """``out/model`` (the shape from a config, warm-started by SFT on ``device`` until greedy held-out accuracy
    reaches ``target`` or ``max_s`` pass: GRPO needs groups whose rewards differ), the task's tokenizer and
    ``out/train.jsonl``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tauflow.trainer.backend import TorchBackend, TorchBackendConfig
    from tauflow.trainer.batch import Sample
    from tauflow.trainer.optim import OptimConfig

    out.mkdir(parents=True, exist_ok=True)
    train, heldout = task.problems(seed=0)
    task.write_jsonl(out / "train.jsonl", train)
    base = out / "base"
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(task.VOCAB), max_position_embeddings=64, tie_word_embeddings=True,
        bos_token_id=task.VOCAB[task.BOS], eos_token_id=task.VOCAB[task.EOS], pad_token_id=task.VOCAB[task.PAD],
        **SHAPES[shape],
    )  # fmt: skip
    model = Qwen2ForCausalLM(config)
    parameters = sum(p.numel() for p in model.parameters())
    model.save_pretrained(base)
    task.build_tokenizer(base)
    cuda = device.startswith("cuda")
    backend = TorchBackend(
        TorchBackendConfig(model_path=str(base), device=device, autocast_dtype="bfloat16" if cuda else None,
                           optim=OptimConfig(lr=1e-4, schedule="constant"), seed=seed)
    )  # fmt: skip
    rng = random.Random(seed)
    started = time.perf_counter()
    losses, accuracy = [], 0.0
    while accuracy < target and time.perf_counter() - started < max_s:
        pairs = rng.sample(train, 64)
        answers = [(task.prompt_ids(a, b), task.answer_ids(a, b)) for a, b in pairs]
        losses.append(backend.sft_step([Sample(q, a, [0.0] * len(a)) for q, a in answers]).loss)  # log-probs unused
        if len(losses) % 25 == 0:
            accuracy = greedy_accuracy(backend.model.eval(), heldout[:200])["all"]
            backend.model.train()
    sft_s = time.perf_counter() - started
    backend.model.save_pretrained(out / "model")
    task.build_tokenizer(out / "model")
    backend.close()
    del backend
    if cuda:
        torch.cuda.empty_cache()
    return {"shape": shape, "parameters": parameters, "sft_steps": len(losses), "sft_s": sft_s,
            "sft_heldout_accuracy": accuracy, "sft_loss_first_last": [losses[0], losses[-1]] if losses else []}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/gpu-grpo"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    p.add_argument("--sft-target", type=float, default=0.2, help="warm start: greedy held-out accuracy to reach")
    p.add_argument("--sft-max-s", type=float, default=90.0, help="warm start: at most this long")
    p.add_argument("--steps", type=int, default=30, help="GRPO steps of each path")
    p.add_argument("--skip", type=int, default=5, help="first steps of each path left out (warm-up)")
    p.add_argument("--groups", type=int, default=64, help="groups per step (8 samples each)")
    p.add_argument("--max-new-tokens", type=int, default=4, help="the task's answers take at most 4")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="run-config override, both paths")
    p.add_argument("--colocated-services", action="store_true",
                   help="a third path, last: every role its own process at τ = 0, colocated (the sidecar's ipc "
                        "backend, the trainer's weights and optimizer state offloaded, the idle engine's weights "
                        "offloaded and its cache released)")
    args = p.parse_args()
    if args.out.exists():
        shutil.rmtree(args.out)
    prepared = args.out / "prepared"
    warm = prepare(prepared, args.shape, args.device, args.sft_target, args.sft_max_s, seed=0)
    report: dict[str, Any] = {"device": args.device, "prepare": warm}
    cuda = args.device.startswith("cuda")
    dtype = "bfloat16" if cuda else "float32"
    extra = [
        f"groups_per_step={args.groups}", f"services.rollout.groups_per_ticket={max(1, args.groups // 4)}",
        f"services.rollout.sampling.max_new_tokens={args.max_new_tokens}",
        f"services.trainer.backend.device={args.device}", f"services.rollout.engine_options.device={args.device}",
        f"services.rollout.engine_options.dtype={dtype}", "services.trainer.backend.optim.lr=1e-5",
        "services.trainer.backend.optim.warmup_steps=0", "services.trainer.checkpoint_every_steps=1000",
        *([f"services.trainer.backend.autocast_dtype={dtype}", f"services.trainer.publish_dtype={dtype}"] if cuda else []),
        *args.set,
    ]  # fmt: skip
    recipe = ADDITION / "config.yaml"

    import torch

    if cuda:
        torch.cuda.reset_peak_memory_stats()  # the warm start ran in this process
    memory = GpuMemory(None, "colocated")
    colocated = in_process(run_config(recipe, prepared, args.out / "colocated", args.steps, extra), args.steps,
                           args.skip)  # fmt: skip
    colocated["gpu_peak_mib"] = memory.stop()
    gc.collect()  # (the in-process loop's models and engine: off the GPU before the next path measures it)
    if cuda:
        torch.cuda.empty_cache()
        colocated["gpu_left_allocated_mib"] = round(torch.cuda.memory_allocated() / 2**20, 1)
    colocated["weights_update_s"] = colocated["weights_s"]
    colocated["weights_update_measures"] = "the copy into the engine in GPU memory and its swap"
    report["colocated_tau0"] = colocated

    config = run_config(recipe, prepared, args.out / "disaggregated", args.steps, [*extra, "max_staleness=1"])
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    memory = GpuMemory(config.run_dir, "bench process (controller)")
    disaggregated = services(config, args.skip)
    disaggregated["gpu_peak_mib"] = memory.stop()
    disaggregated["weights_update_s"] = disaggregated["publish_s"]
    disaggregated["weights_update_measures"] = PUBLISH_MEASURES
    report["disaggregated_tau1"] = disaggregated
    report["speedup_step_time"] = colocated["step_s"] / disaggregated["step_s"]  # (in-process against services)
    paths = ["colocated_tau0", "disaggregated_tau1"]
    for name in paths:
        r = report[name]
        r["trained_tokens_per_s"] = r["trained_tokens_per_step"] / r["step_s"] if r.get("step_s") else None
    (args.out / "gpu_grpo.json").write_text(json.dumps(report, indent=2))  # (again below with the third path)

    if args.colocated_services:
        shared = ["max_staleness=0", "services.weights.backend=ipc"]
        if cuda:
            shared += ["services.trainer.backend.offload_optimizer=true",
                       "services.trainer.backend.offload_model=true",
                       "services.rollout.engine_options.offload_weights_when_idle=true",
                       "services.rollout.engine_options.release_memory_when_idle=true"]
        config = run_config(recipe, prepared, args.out / "colocated-services", args.steps, [*extra, *shared])
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        memory = GpuMemory(config.run_dir, "bench process (controller)")
        r = services(config, args.skip)
        r["gpu_peak_mib"] = memory.stop()
        r["weights_update_s"] = r["publish_s"]
        r["weights_update_measures"] = PUBLISH_MEASURES
        r["trained_tokens_per_s"] = r["trained_tokens_per_step"] / r["step_s"] if r.get("step_s") else None
        report["colocated_services_tau0"] = r
        report["speedup_step_time_vs_colocated_services"] = r["step_s"] / disaggregated["step_s"]
        paths.append("colocated_services_tau0")

    print(f"{'path':24} {'step ms':>8} {'tokens/s':>9} {'weights ms':>10} {'reward first→last':>18}")
    for name in paths:
        r = report[name]
        rewards = r["mean_reward"]
        print(f"{name:24} {r['step_s'] * 1000:8.1f} {r['trained_tokens_per_s'] or 0:9.0f} "
              f"{r['weights_update_s'] * 1000:10.1f} {rewards[0]:8.3f}→{rewards[-1]:.3f}")  # fmt: skip
    if "colocated_services_tau0" in report:  # (like for like: the headline)
        print(f"async τ=1 over colocated τ=0, both as services: {report['speedup_step_time_vs_colocated_services']:.2f}×")
    print(f"async τ=1 as services over the in-process colocated loop: {report['speedup_step_time']:.2f}×")
    (args.out / "gpu_grpo.json").write_text(json.dumps(report, indent=2))
    print("BENCH_JSON " + json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
