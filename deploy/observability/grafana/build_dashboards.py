"""Writes the Grafana dashboards of deploy/observability/grafana/dashboards/ (JSON, provisioned as files).

    python deploy/observability/grafana/build_dashboards.py          # rewrite the JSON files
    python deploy/observability/grafana/build_dashboards.py --check  # exit 1 when a file is out of date

Edit the dashboards here, not in the JSON: tests/contract/test_metrics_catalog.py checks that the files
are what this script writes and that every query names only metrics the services export.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "dashboards"
PROM = {"type": "prometheus", "uid": "prometheus"}
RATE = "$__rate_interval"


class Board:
    def __init__(self, uid: str, title: str, description: str) -> None:
        self.uid, self.title, self.description = uid, title, description
        self.panels: list[dict] = []
        self.y = 0
        self.x = 0
        self.row_h = 0

    def row(self, title: str) -> None:
        self._newline()
        self.panels.append({"type": "row", "title": title, "collapsed": False, "panels": [],
                            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y}, "id": len(self.panels) + 1})
        self.y += 1

    def _newline(self) -> None:
        if self.x:
            self.y += self.row_h
            self.x, self.row_h = 0, 0

    def panel(self, title: str, targets: list[tuple[str, str]], *, kind: str = "timeseries", unit: str = "short",
              w: int = 8, h: int = 8, description: str = "", stack: bool = False, decimals: int | None = None) -> None:
        if self.x + w > 24:
            self._newline()
        defaults: dict = {"unit": unit}
        if decimals is not None:
            defaults["decimals"] = decimals
        if kind == "timeseries":
            defaults["custom"] = {"fillOpacity": 30 if stack else 10, "showPoints": "never",
                                  "stacking": {"mode": "normal" if stack else "none", "group": "A"}}
        p = {
            "id": len(self.panels) + 1, "type": kind, "title": title, "description": description, "datasource": PROM,
            "gridPos": {"h": h, "w": w, "x": self.x, "y": self.y},
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                        "tooltip": {"mode": "multi", "sort": "none"}} if kind == "timeseries" else
                       {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                        "colorMode": "value", "graphMode": "area", "textMode": "auto"},
            "targets": [{"refId": chr(ord("A") + i), "datasource": PROM, "expr": expr, "legendFormat": legend}
                        for i, (expr, legend) in enumerate(targets)],
        }
        self.panels.append(p)
        self.x += w
        self.row_h = max(self.row_h, h)

    def stat(self, title: str, expr: str, unit: str = "short", w: int = 4, description: str = "",
             decimals: int | None = None) -> None:
        self.panel(title, [(expr, "")], kind="stat", unit=unit, w=w, h=4, description=description, decimals=decimals)

    def json(self) -> dict:
        return {
            "uid": self.uid, "title": self.title, "description": self.description, "tags": ["tauflow"],
            "editable": True, "schemaVersion": 39, "version": 1, "refresh": "10s", "timezone": "browser",
            "time": {"from": "now-30m", "to": "now"}, "graphTooltip": 1,
            "links": [{"title": "tauflow dashboards", "type": "dashboards", "tags": ["tauflow"], "asDropdown": True}],
            "annotations": {"list": []}, "templating": {"list": []}, "panels": self.panels,
        }


def mean(hist: str, by: str = "") -> str:
    group = f" by ({by})" if by else ""
    return f"sum{group} (rate({hist}_sum[{RATE}])) / sum{group} (rate({hist}_count[{RATE}]))"


def quantile(q: float, hist: str, by: str = "") -> str:
    extra = f", {by}" if by else ""
    return f"histogram_quantile({q}, sum by (le{extra}) (rate({hist}_bucket[{RATE}])))"


def overview() -> Board:
    b = Board("tauflow-overview", "tauflow: run overview",
              "Reward and accuracy, staleness, throughput, queue depth, the trainer's step time and the weight sync")
    b.row("run")
    b.stat("policy version", "max(tauflow_trainer_policy_version)", description="committed optimizer steps")
    b.stat("progress", "max(tauflow_controller_policy_version) / max(tauflow_controller_target_steps)",
           unit="percentunit", decimals=1)
    b.stat("held-out accuracy", "max(tauflow_controller_heldout_accuracy_ratio)", unit="percentunit", decimals=1)
    b.stat("tau (max staleness)", "max(tauflow_queue_max_staleness_steps)")
    b.stat("roles up", "sum(tauflow_controller_service_up)", description="of the roles the controller launched")
    b.stat("restarts", "sum(tauflow_controller_service_restarts_total)")
    b.row("learning")
    b.panel("batch reward and held-out accuracy", [
        ("tauflow_trainer_reward_mean", "batch reward (mean)"),
        ("tauflow_controller_heldout_accuracy_ratio", "held-out accuracy"),
    ], w=12, description="the trainer's mean reward of each batch; the controller's greedy held-out accuracy")
    b.panel("loss, KL, clip fraction", [
        ("tauflow_trainer_loss", "loss"),
        ("tauflow_trainer_kl_behaviour_nats", "KL(behaviour, policy)"),
        ("tauflow_trainer_clipped_tokens_ratio", "clipped tokens"),
    ], w=12)
    b.row("staleness")
    b.panel("staleness (steps)", [
        (mean("tauflow_queue_delivered_staleness_steps"), "delivered, mean"),
        ("max(tauflow_trainer_batch_mean_staleness_steps)", "last batch, mean"),
        (quantile(1.0, "tauflow_trainer_batch_max_staleness_steps"), "batch max"),
        ("max(tauflow_queue_max_staleness_steps)", "tau"),
    ], w=12)
    b.panel("policy versions", [
        ("max(tauflow_trainer_policy_version)", "trainer"),
        ("max(tauflow_weights_confirmed_policy_version)", "confirmed by every engine"),
        ("min(tauflow_rollout_engine_policy_version)", "oldest engine"),
    ], w=12, description="how far the engines lag the trainer")
    b.row("throughput")
    b.panel("tokens per second", [
        (f"sum(rate(tauflow_rollout_generated_tokens_total[{RATE}]))", "generated (rollout)"),
        (f"sum(rate(tauflow_trainer_trained_tokens_total[{RATE}]))", "trained"),
    ], w=12)
    b.panel("steps per minute", [(f"60 * sum(rate(tauflow_trainer_steps_total[{RATE}]))", "steps/min")], w=12)
    b.row("queue")
    b.panel("queue depth (groups)", [
        ("sum(tauflow_queue_depth_groups)", "waiting"),
        ("sum(tauflow_queue_reserved_groups)", "reserved (in rollout)"),
        ("sum(tauflow_queue_leased_groups)", "leased (in a step)"),
        ("sum(tauflow_queue_pacing_limit_groups - tauflow_queue_accepted_groups)", "pacing room"),
    ], w=12)
    b.panel("evictions and drops (groups/s)", [
        (f"sum by (reason) (rate(tauflow_queue_evicted_total[{RATE}]))", "evicted {{reason}}"),
        (f"sum by (reason) (rate(tauflow_rollout_dropped_groups_total[{RATE}]))", "dropped {{reason}}"),
    ], w=12)
    b.row("step time and weight sync")
    b.panel("step time by phase (mean)", [
        (mean("tauflow_trainer_step_phase_duration_seconds", "phase"), "{{phase}}"),
    ], unit="s", w=12, stack=True, description="wait for data, train, publish to the sidecar")
    b.panel("weight broadcast", [
        (quantile(0.5, "tauflow_weights_broadcast_duration_seconds"), "broadcast p50"),
        (quantile(0.9, "tauflow_weights_broadcast_duration_seconds"), "broadcast p90"),
        (quantile(0.9, "tauflow_weights_member_load_duration_seconds"), "engine load p90"),
        (f"sum by (outcome) (increase(tauflow_weights_broadcasts_total{{outcome=\"failed\"}}[{RATE}]))",
         "failed broadcasts"),
    ], unit="s", w=12)
    return b


def rollout() -> Board:
    b = Board("tauflow-rollout", "tauflow: rollout", "Generation engines and the rollout loop")
    b.row("engine")
    b.panel("tokens per second", [
        (f"sum by (instance) (rate(tauflow_rollout_generated_tokens_total[{RATE}]))", "generated {{instance}}"),
        (f"sum by (instance) (rate(tauflow_rollout_prefill_tokens_total[{RATE}]))", "prefilled {{instance}}"),
    ])
    b.panel("sequences", [
        ("sum by (instance) (tauflow_rollout_engine_running_sequences)", "running {{instance}}"),
        ("sum by (instance) (tauflow_rollout_engine_waiting_sequences)", "waiting {{instance}}"),
        (f"sum by (instance) (rate(tauflow_rollout_generated_sequences_total[{RATE}]))", "finished/s {{instance}}"),
    ])
    b.panel("tokens per decoding step", [
        ((f"sum by (instance) (rate(tauflow_rollout_generated_tokens_total[{RATE}])) / "
          f"sum by (instance) (rate(tauflow_rollout_decode_steps_total[{RATE}]))"), "{{instance}}"),
    ])
    b.panel("engine policy version", [
        ("tauflow_rollout_engine_policy_version", "{{instance}}"),
        ("max(tauflow_trainer_policy_version)", "trainer"),
    ])
    b.panel("weight swaps", [
        (f"sum by (instance) (increase(tauflow_rollout_weight_swaps_total[{RATE}]))", "swaps {{instance}}"),
        (f"sum by (instance) (rate(tauflow_rollout_kv_recomputed_tokens_total[{RATE}]))", "re-prefilled tokens/s"),
    ])
    b.panel("engine state", [("tauflow_rollout_engine_state", "{{instance}}")],
            description="1 starting, 2 waiting for weights, 3 serving, 4 draining, 5 failed")
    b.row("loop and requests")
    b.panel("in flight", [
        ("sum by (instance) (tauflow_rollout_inflight_groups)", "groups {{instance}}"),
        ("sum by (instance) (tauflow_rollout_inflight_requests)", "Generate RPCs {{instance}}"),
        ("sum by (instance) (tauflow_rollout_engine_inflight_requests)", "engine requests {{instance}}"),
    ])
    b.panel("groups per second", [
        (f"sum(rate(tauflow_rollout_produced_groups_total[{RATE}]))", "produced"),
        (f"sum by (reason) (rate(tauflow_rollout_dropped_groups_total[{RATE}]))", "dropped {{reason}}"),
        (f"sum by (why) (rate(tauflow_rollout_released_tickets_total[{RATE}]))", "tickets released {{why}}"),
    ])
    b.panel("sidecar joins", [(f"sum by (instance) (increase(tauflow_rollout_sidecar_joins_total[{RATE}]))",
                               "{{instance}}")])
    return b


def reward() -> Board:
    b = Board("tauflow-reward", "tauflow: reward", "Reward functions: volume, failures, latency, scores")
    b.panel("samples scored per second", [
        (f"sum by (fn, status) (rate(tauflow_reward_scored_samples_total[{RATE}]))", "{{fn}} {{status}}"),
    ], w=12)
    b.panel("fallback scores per second", [
        (f"sum by (fn, reason) (rate(tauflow_reward_failures_total[{RATE}]))", "{{fn}} {{reason}}"),
    ], w=12)
    b.panel("mean score", [(mean("tauflow_reward_score", "fn"), "{{fn}}")], w=8)
    b.panel("function time per sample", [
        (quantile(0.5, "tauflow_reward_function_duration_seconds", "fn"), "p50 {{fn}}"),
        (quantile(0.99, "tauflow_reward_function_duration_seconds", "fn"), "p99 {{fn}}"),
    ], unit="s", w=8)
    b.panel("RPC latency p90", [(quantile(0.9, "tauflow_reward_rpc_duration_seconds", "method"), "{{method}}")],
            unit="s", w=8)
    b.panel("load", [
        ("sum(tauflow_reward_inflight_requests)", "Score calls in progress"),
        ("sum(tauflow_reward_pool_workers)", "pool workers"),
    ], w=12)
    b.panel("rejected requests", [
        (f"sum by (method, code) (rate(tauflow_reward_rejected_requests_total[{RATE}]))", "{{method}} {{code}}"),
    ], w=12)
    return b


def queue() -> Board:
    b = Board("tauflow-queue", "tauflow: queue", "Pacing, depth, leases, staleness, durability")
    b.panel("depth (groups)", [
        ("tauflow_queue_depth_groups", "waiting"), ("tauflow_queue_reserved_groups", "reserved"),
        ("tauflow_queue_leased_groups", "leased"),
        ("(tauflow_queue_max_staleness_steps + 1) * tauflow_queue_groups_per_step", "(tau + 1) x groups/step"),
    ])
    b.panel("pacing", [
        ("tauflow_queue_accepted_groups + tauflow_queue_reserved_groups", "accepted + reserved"),
        ("tauflow_queue_pacing_limit_groups", "limit"),
    ], description="(trainer_version + tau + 1) x groups_per_step bounds accepted + reserved")
    b.panel("depth (bytes)", [("tauflow_queue_depth_bytes", "waiting"), ("tauflow_queue_wal_bytes", "write-ahead log"),
                              ("tauflow_queue_capacity_bytes", "capacity")], unit="bytes")
    b.panel("groups per second", [
        (f"rate(tauflow_queue_put_groups_total[{RATE}])", "put"),
        (f"rate(tauflow_queue_delivered_groups_total[{RATE}])", "delivered"),
        (f"rate(tauflow_queue_acked_groups_total[{RATE}])", "acked"),
        (f"sum by (reason) (rate(tauflow_queue_evicted_total[{RATE}]))", "evicted {{reason}}"),
    ])
    b.panel("delivered staleness (steps)", [
        (mean("tauflow_queue_delivered_staleness_steps"), "mean"),
        (quantile(0.99, "tauflow_queue_delivered_staleness_steps"), "p99"),
        ("tauflow_queue_max_staleness_steps", "tau"),
    ])
    b.panel("leases", [(f"increase(tauflow_queue_lease_expired_total[{RATE}])", "expired"),
                       ("tauflow_queue_trainer_version", "trainer version")])
    b.panel("waiting long polls", [("tauflow_queue_waiting_calls", "{{method}}")],
            description="Get: the trainer waiting for groups (starved); Reserve: producers waiting for room (pacing, capacity)")
    b.panel("RPC latency p90 (long polls included)",
            [(quantile(0.9, "tauflow_queue_rpc_duration_seconds", "method"), "{{method}}")], unit="s", w=12)
    b.panel("rejected requests", [
        (f"sum by (method, code) (rate(tauflow_queue_rejected_requests_total[{RATE}]))", "{{method}} {{code}}"),
        (f"rate(tauflow_queue_put_bytes_total[{RATE}])", "put bytes/s"),
    ], w=12)
    return b


def trainer() -> Board:
    b = Board("tauflow-trainer", "tauflow: trainer", "Steps: time by phase, loss, reward, KL, clipping, throughput")
    b.panel("step time by phase (mean)", [(mean("tauflow_trainer_step_phase_duration_seconds", "phase"), "{{phase}}")],
            unit="s", stack=True)
    b.panel("step time p90", [
        (quantile(0.9, "tauflow_trainer_step_phase_duration_seconds", "phase"), "{{phase}}"),
        (quantile(0.9, "tauflow_trainer_step_duration_seconds"), "backend step"),
    ], unit="s")
    b.panel("throughput", [
        (f"rate(tauflow_trainer_trained_tokens_total[{RATE}])", "tokens/s"),
        (f"60 * rate(tauflow_trainer_steps_total[{RATE}])", "steps/min"),
    ])
    b.panel("loss and reward", [("tauflow_trainer_loss", "loss"), ("tauflow_trainer_reward_mean", "reward")])
    b.panel("KL and entropy (nats)", [
        ("tauflow_trainer_kl_behaviour_nats", "KL behaviour"), ("tauflow_trainer_kl_ref_nats", "KL reference"),
        ("tauflow_trainer_entropy_nats", "entropy"),
    ])
    b.panel("clipping", [
        ("tauflow_trainer_clipped_tokens_ratio", "clipped"), ("tauflow_trainer_is_truncated_tokens_ratio", "IS truncated"),
    ], unit="percentunit")
    b.panel("gradient norm and learning rate", [("tauflow_trainer_grad_norm", "grad norm"),
                                                ("tauflow_trainer_learning_rate", "lr")])
    b.panel("staleness (steps)", [
        ("tauflow_trainer_batch_mean_staleness_steps", "batch mean"),
        (quantile(1.0, "tauflow_trainer_batch_max_staleness_steps"), "batch max"),
    ])
    b.panel("groups per second", [
        (f"rate(tauflow_trainer_trained_groups_total[{RATE}])", "trained"),
        (f"rate(tauflow_trainer_trained_samples_total[{RATE}])", "samples"),
        (f"sum by (reason) (rate(tauflow_trainer_skipped_groups_total[{RATE}]))", "skipped {{reason}}"),
    ])
    return b


def weights() -> Board:
    b = Board("tauflow-weights", "tauflow: weight sidecar", "Publishes, broadcasts, members, failures")
    b.panel("versions", [
        ("tauflow_weights_latest_policy_version", "latest published"),
        ("tauflow_weights_confirmed_policy_version", "confirmed by every member"),
        (f"increase(tauflow_weights_superseded_versions_total[{RATE}])", "superseded"),
    ])
    b.panel("broadcast duration", [
        (quantile(0.5, "tauflow_weights_broadcast_duration_seconds"), "p50"),
        (quantile(0.9, "tauflow_weights_broadcast_duration_seconds"), "p90"),
        (quantile(0.9, "tauflow_weights_handoff_duration_seconds"), "handoff p90"),
    ], unit="s")
    b.panel("phases (mean)", [(mean("tauflow_weights_phase_duration_seconds", "phase"), "{{phase}}")], unit="s")
    b.panel("broadcasts", [
        (f"sum by (outcome) (increase(tauflow_weights_broadcasts_total[{RATE}]))", "{{outcome}}"),
        (f"sum by (phase) (increase(tauflow_weights_phase_failures_total[{RATE}]))", "failed {{phase}}"),
        (f"increase(tauflow_weights_handoff_failures_total[{RATE}])", "handoff failures"),
    ])
    b.panel("bytes", [
        (f"rate(tauflow_weights_broadcast_bytes_total[{RATE}])", "broadcast/s"),
        (f"rate(tauflow_weights_published_bytes_total[{RATE}])", "published/s"),
        ("tauflow_weights_broadcast_bandwidth_bytes_per_second", "last transfer bandwidth"),
        ("tauflow_weights_retained_bytes", "retained"),
    ], unit="bytes")
    b.panel("members", [("sum by (state) (tauflow_weights_members)", "{{state}}"),
                        ("tauflow_weights_membership_epoch", "epoch")])
    b.panel("engine load time", [(quantile(0.9, "tauflow_weights_member_load_duration_seconds"), "p90")], unit="s")
    b.panel("versions broadcast per minute", [(f"60 * rate(tauflow_weights_versions_broadcast_total[{RATE}])", "")])
    b.panel("RPCs", [
        (quantile(0.9, "tauflow_weights_rpc_duration_seconds", "method"), "p90 {{method}}"),
        (f"sum by (method, code) (rate(tauflow_weights_rejected_requests_total[{RATE}]))", "rejected {{method}} {{code}}"),
    ])
    return b


def controller() -> Board:
    b = Board("tauflow-controller", "tauflow: controller", "Role health and restarts, the run's progress")
    b.panel("roles up", [("tauflow_controller_service_up", "{{service}}"), ("up{job=~\"tauflow.*\"}", "scraped {{job}}")],
            w=12, description="service_up: the controller's view of each process; up: Prometheus' scrape")
    b.panel("restarts", [("tauflow_controller_service_restarts_total", "{{service}}")], w=12)
    b.panel("progress", [("tauflow_controller_policy_version", "policy version"),
                         ("tauflow_controller_target_steps", "target")], w=8)
    b.panel("held-out accuracy", [("tauflow_controller_heldout_accuracy_ratio", "accuracy")], unit="percentunit", w=8)
    b.panel("evaluations", [("tauflow_controller_evaluations_total", "evaluations"),
                            ("tauflow_controller_heldout_policy_version", "evaluated version"),
                            ("tauflow_controller_max_staleness_steps", "tau")], w=8)
    return b


BOARDS = {"overview": overview, "rollout": rollout, "reward": reward, "queue": queue, "trainer": trainer,
          "weights": weights, "controller": controller}


def render() -> dict[str, str]:
    return {f"{name}.json": json.dumps(make().json(), indent=1) + "\n" for name, make in BOARDS.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 when a dashboard file is out of date")
    args = parser.parse_args()
    stale = []
    for name, text in render().items():
        path = OUT / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            OUT.mkdir(exist_ok=True)
            path.write_text(text)
    if stale:
        print(f"out of date: {', '.join(stale)}; run {Path(__file__).name}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
