"""``tauflow trace``: a run's spans (the JSON lines of ``traces_file``) turned into the rollout-to-update
latency breakdown of every trained group.

For each group (its ``queue.put`` span in a ``rollout.ticket`` trace, docs/observability.md) and the
``trainer.step`` that links to it, the phases of its way from the rollout to weights that reflect it
being served:

- ``generate``: its ticket's ``rollout.generate`` span (the batched generation it was part of);
- ``score``: its ticket's ``reward.score`` span;
- ``queue_wait``: from the end of its ``queue.put`` to the end of the consuming step's ``queue.get`` that
  delivered it (the first Get of the step that ended after the put; the last one otherwise);
- ``train``: from the step's last ``queue.get`` end to the end of its last ``optimizer.step``;
- ``publish``: the step's ``weights.publish`` (the trainer's hand-off to the sidecar);
- ``broadcast``: the sidecar's ``weights.broadcast`` that links to that publish; when the sidecar skipped
  the version (a newer one was published meanwhile), the first broadcast of a newer version that started
  after the publish;
- ``load``: the engines' ``weights.load`` spans that link to the publish (or, likewise, of the first newer
  version each engine loaded), the slowest engine's; an engine whose first load is of a newer version (it
  joined later) is left out;
- ``total``: from the start of its ``rollout.ticket`` span to the end of the last engine's load.

A phase that a group lacks (no trainer step yet, a version never broadcast) is left out of its statistics.
"""

from __future__ import annotations

import json
import logging
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

PHASES = ("generate", "score", "queue_wait", "train", "publish", "broadcast", "load", "total")
DEFAULT_FILE = "traces.jsonl"
Span = dict[str, Any]


@dataclass
class GroupLatency:
    group_id: str
    trace_id: str
    step: int | None = None
    policy_version: int | None = None  # the version the consuming step made
    generate: float | None = None
    score: float | None = None
    queue_wait: float | None = None
    train: float | None = None
    publish: float | None = None
    broadcast: float | None = None
    load: float | None = None
    total: float | None = None


@dataclass
class PhaseStats:
    phase: str
    n: int
    median: float
    p90: float
    mean: float


def traces_path(path: str | Path) -> Path:
    """A run folder means its ``traces.jsonl``; a file is itself."""
    p = Path(path)
    if p.is_dir():
        p = p / DEFAULT_FILE
    if not p.exists():
        raise FileNotFoundError(f"{p}: no span file (set `traces_file: {DEFAULT_FILE}` in the run config)")
    return p


class NoSpans(ValueError):
    """The file holds no span (not a run's traces_file: its summary.json, say)."""


def _is_span(value: Any) -> bool:
    """A span as tauflow.core.telemetry writes it, as far as the breakdown reads it."""
    return (
        isinstance(value, dict)
        and all(isinstance(value.get(k), str) for k in ("name", "trace_id", "span_id"))
        and all(isinstance(value.get(k), int) for k in ("start_ns", "end_ns"))
        and isinstance(value.get("parent_span_id"), (str, type(None)))
        and isinstance(value.get("attributes"), dict)
        and isinstance(value.get("links"), list)
        and all(isinstance(link, dict) and {"trace_id", "span_id"} <= link.keys() for link in value["links"])
    )


def load_spans(path: str | Path) -> list[Span]:
    """The spans of a JSON lines file; a line that does not parse (a writer killed mid-line) or is no span is
    skipped. Raises NoSpans when nothing is left."""
    spans, skipped = [], 0
    source = traces_path(path)
    with open(source, errors="replace") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                value = json.loads(line)
            except (json.JSONDecodeError, RecursionError):
                value = None
            if _is_span(value):
                spans.append(value)
            else:
                skipped += 1
    if not spans:
        raise NoSpans(f"{source} holds no spans ({skipped} lines, none a span): is it a run's traces_file?")
    return spans


def _s(ns: int) -> float:
    return ns / 1e9


def _duration(span: Span | None) -> float | None:
    return None if span is None else _s(span["end_ns"] - span["start_ns"])


def _linked_to(span: Span, target: Span) -> bool:
    return any(
        link["span_id"] == target["span_id"] and link["trace_id"] == target["trace_id"] for link in span["links"]
    )


def breakdown(spans: Iterable[Span]) -> list[GroupLatency]:
    """One record per group (its ``queue.put`` span under a ``rollout.ticket``), in the order of the tickets'
    starts, then of the puts'."""
    spans = list(spans)
    children: dict[str, list[Span]] = defaultdict(list)
    for s in spans:
        if s.get("parent_span_id"):
            children[s["parent_span_id"]].append(s)
    named: dict[str, list[Span]] = defaultdict(list)
    for s in spans:
        named[s["name"]].append(s)
    # Which step consumed which group: trainer.step links to the group's queue.put span.
    steps_of: dict[tuple[str, str], list[Span]] = defaultdict(list)
    for step in named["trainer.step"]:
        for link in step["links"]:
            steps_of[(link["trace_id"], link["span_id"])].append(step)

    def child(parent: Span, name: str) -> list[Span]:
        return sorted((c for c in children[parent["span_id"]] if c["name"] == name), key=lambda c: c["start_ns"])

    out = []
    tickets = {s["span_id"]: s for s in named["rollout.ticket"]}
    puts = [(tickets[p["parent_span_id"]], p) for p in named["queue.put"] if p.get("parent_span_id") in tickets]
    for ticket, put in sorted(puts, key=lambda tp: (tp[0]["start_ns"], tp[1]["start_ns"])):
        rec = GroupLatency(group_id=str(put["attributes"].get("rl.group_id", "")), trace_id=put["trace_id"])
        out.append(rec)
        generate, score = (next(iter(child(ticket, n)), None) for n in ("rollout.generate", "reward.score"))
        rec.generate, rec.score = _duration(generate), _duration(score)
        steps = steps_of.get((put["trace_id"], put["span_id"]), [])
        # A redelivered group can be linked by a second step that skipped it; the committed one trained it.
        steps.sort(key=lambda s: (not s["attributes"].get("rl.committed", True), s["start_ns"]))
        if not steps:
            continue
        step = steps[0]
        rec.step = step["attributes"].get("rl.step")
        rec.policy_version = step["attributes"].get("rl.policy_version")
        gets = child(step, "queue.get")
        if gets:
            after = [g for g in gets if g["end_ns"] >= put["end_ns"]]
            delivered = min(after, key=lambda g: g["end_ns"]) if after else gets[-1]
            rec.queue_wait = max(0.0, _s(delivered["end_ns"] - put["end_ns"]))
        optimizers = child(step, "optimizer.step")  # one per optimizer update of the step: the last ends it
        if optimizers and gets:
            rec.train = _s(max(o["end_ns"] for o in optimizers) - max(g["end_ns"] for g in gets))
        publish = next(iter(child(step, "weights.publish")), None)
        rec.publish = _duration(publish)
        if publish is None:
            continue
        version = publish["attributes"].get("rl.policy_version", rec.policy_version)
        broadcast = _delivery(named["weights.broadcast"], publish, version)
        rec.broadcast = _duration(broadcast)
        loads = _loads(named["weights.load"], publish, version)
        if loads:
            rec.load = max(_duration(s) or 0.0 for s in loads)
            rec.total = _s(max(s["end_ns"] for s in loads) - ticket["start_ns"])
    return out


def _ok(span: Span) -> bool:
    return span.get("status") != "ERROR"


def _delivery(candidates: Sequence[Span], publish: Span, version: int | None) -> Span | None:
    """The span (broadcast) that delivered ``publish``'s version: the successful one linking to it, else
    the first successful one of a newer version that began after the publish."""
    linked = [s for s in candidates if _linked_to(s, publish) and _ok(s)]
    if linked:
        return min(linked, key=lambda s: s["end_ns"])
    if version is None:
        return None
    newer = [
        s
        for s in candidates
        if _ok(s) and s["start_ns"] >= publish["start_ns"] and s["attributes"].get("rl.policy_version", -1) >= version
    ]
    return min(newer, key=lambda s: s["end_ns"]) if newer else None


def _loads(candidates: Sequence[Span], publish: Span, version: int | None) -> list[Span]:
    """For each engine, the load that first served ``publish``'s version or a newer one."""
    by_member: dict[str, list[Span]] = defaultdict(list)
    for s in candidates:
        by_member[str(s["attributes"].get("weights.member_id", s.get("service", "")))].append(s)
    out = []
    for spans in by_member.values():
        # An engine that joined later (tauflow scale) first loads a newer version: it never served this one,
        # and its first load, waited for, stretched `total` of every group before it (41 s against 1 s).
        versions = [int(v) for sp in spans if isinstance(v := sp["attributes"].get("rl.policy_version"), int)]
        if version is not None and versions and min(versions) > version:
            continue
        found = _delivery(spans, publish, version)
        if found is not None:
            out.append(found)
    return out


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile with linear interpolation between order statistics (numpy's default)."""
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def phase_stats(records: Sequence[GroupLatency]) -> list[PhaseStats]:
    stats = []
    for phase in PHASES:
        values = [v for r in records if (v := getattr(r, phase)) is not None]
        if values:
            stats.append(
                PhaseStats(phase, len(values), quantile(values, 0.5), quantile(values, 0.9), sum(values) / len(values))
            )
        else:
            stats.append(PhaseStats(phase, 0, math.nan, math.nan, math.nan))
    return stats


def format_table(stats: Sequence[PhaseStats], records: Sequence[GroupLatency]) -> str:
    trained = sum(r.step is not None for r in records)
    lines = [
        f"rollout-to-update latency: {len(records)} groups traced, {trained} trained",
        f"{'phase':<12}{'groups':>8}{'median s':>12}{'p90 s':>12}{'mean s':>12}",
    ]
    for s in stats:
        if s.n:
            lines.append(f"{s.phase:<12}{s.n:>8}{s.median:>12.4f}{s.p90:>12.4f}{s.mean:>12.4f}")
        else:
            lines.append(f"{s.phase:<12}{0:>8}{'-':>12}{'-':>12}{'-':>12}")
    return "\n".join(lines)


def plot(stats: Sequence[PhaseStats], path: Path, title: str = "") -> None:
    """Median (bar) and p90 (whisker) of each phase, in seconds."""
    import matplotlib

    matplotlib.use("Agg")
    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # (its INFO lines were the service log's last)
    import matplotlib.pyplot as plt

    shown = [s for s in stats if s.n]
    fig, ax = plt.subplots(figsize=(8, 0.5 * max(len(shown), 1) + 1.5))
    names = [f"{s.phase} (n={s.n})" for s in shown]
    medians = [s.median for s in shown]
    errs = [max(0.0, s.p90 - s.median) for s in shown]
    ax.barh(names, medians, xerr=[[0.0] * len(shown), errs], color="tab:blue", ecolor="tab:gray", capsize=4)
    ax.invert_yaxis()
    ax.set_xlabel("seconds (bar: median, whisker: p90)")
    ax.set_title(title or "rollout-to-update latency by phase")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def summarize_file(path: str | Path, png: Path | None = None, json_out: Path | None = None) -> str:
    """Reads the spans, writes the PNG (default: ``traces.png`` beside the span file) and optionally the
    records as JSON; returns the table."""
    source = traces_path(path)
    records = breakdown(load_spans(source))
    stats = phase_stats(records)
    plot(stats, png or source.with_name("traces.png"), title=f"rollout-to-update latency ({source.parent.name})")
    if json_out is not None:
        json_out.write_text(
            json.dumps(
                {"phases": [asdict(s) for s in stats], "groups": [asdict(r) for r in records]},
                indent=1,
                default=str,
            )
        )
    return format_table(stats, records)
