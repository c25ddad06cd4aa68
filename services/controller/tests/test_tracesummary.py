"""`tauflow trace`: hand-made spans in, known latencies out."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest

from tauflow.controller.tracesummary import breakdown, load_spans, phase_stats, quantile

T0 = 1_700_000_000 * 10**9
_ids = itertools.count(1)


def span(name, start, end, trace_id, parent=None, links=(), status="UNSET", **attributes):
    return {
        "name": name,
        "service": "x",
        "trace_id": trace_id,
        "span_id": f"{next(_ids):016x}",
        "parent_span_id": parent["span_id"] if parent else None,
        "kind": "INTERNAL",
        "start_ns": T0 + round(start * 1e9),
        "end_ns": T0 + round(end * 1e9),
        "status": status,
        "status_message": "",
        "attributes": attributes,
        "links": [{"trace_id": s["trace_id"], "span_id": s["span_id"], "attributes": {}} for s in links],
    }


def group(trace_id: str, gid: str, gen: tuple[float, float], score: tuple[float, float], put: tuple[float, float]):
    """A ticket of one group, as the rollout traces it: the group's span (what a step links to) is its put."""
    root = span("rollout.ticket", gen[0], put[1], trace_id)
    put_span = span("queue.put", *put, trace_id, root, **{"rl.group_id": gid})
    return put_span, [
        root,
        span("rollout.generate", *gen, trace_id, root),
        span("reward.score", *score, trace_id, root),
        put_span,
    ]


def step(trace_id, k, roots, gets, optimizer_end, publish, committed=True):
    s = span(
        "trainer.step",
        gets[0][0],
        publish[1],
        trace_id,
        links=roots,
        **{"rl.step": k, "rl.policy_version": k + 1, "rl.committed": committed},
    )
    children = [span("queue.get", a, b, trace_id, s) for a, b in gets]
    children += [
        span("forward_backward", gets[-1][1], optimizer_end - 0.1, trace_id, s),
        span("optimizer.step", optimizer_end - 0.1, optimizer_end, trace_id, s),
    ]
    pub = span("weights.publish", *publish, trace_id, s, **{"rl.policy_version": k + 1})
    return pub, [s, *children, pub]


@pytest.fixture
def spans() -> list[dict]:
    out: list[dict] = []
    a, sa = group("a" * 32, "A", (0, 1.0), (1.0, 1.5), (1.5, 1.6))
    b, sb = group("b" * 32, "B", (0, 1.0), (1.0, 1.2), (1.2, 1.4))
    c, sc = group("c" * 32, "C", (2, 3.0), (3.0, 3.5), (3.5, 3.6))
    _, sd = group("d" * 32, "D", (4, 5.0), (5.0, 5.25), (5.25, 5.5))  # never trained
    out += sa + sb + sc + sd
    # Step 0 takes A and B in two Gets: B is delivered by the first (ends 1.5), A by the second (ends 2.0).
    p1, s1 = step("1" * 32, 0, [a, b], [(1.0, 1.5), (1.5, 2.0)], optimizer_end=3.0, publish=(3.0, 3.2))
    out += s1
    out.append(span("weights.broadcast", 3.2, 4.0, "e" * 32, links=[p1], **{"rl.policy_version": 1}))
    out.append(
        span("weights.load", 3.3, 4.1, "e" * 32, links=[p1], **{"rl.policy_version": 1, "weights.member_id": "e1"})
    )
    out.append(
        span("weights.load", 3.3, 4.5, "e" * 32, links=[p1], **{"rl.policy_version": 1, "weights.member_id": "e2"})
    )
    # A redelivery of A to a later step that skipped it (not committed) must not count.
    _, s_dup = step("9" * 32, 5, [a], [(8.0, 8.5)], optimizer_end=9.0, publish=(9.0, 9.1), committed=False)
    out += s_dup
    # Step 1 takes C; its version 2 is superseded: a failed broadcast links to it, then version 3 goes out.
    p2, s2 = step("2" * 32, 1, [c], [(3.0, 4.0)], optimizer_end=5.0, publish=(5.0, 5.1))
    out += s2
    out.append(span("weights.broadcast", 5.2, 5.5, "f" * 32, links=[p2], status="ERROR", **{"rl.policy_version": 2}))
    p3, s3 = step("3" * 32, 2, [], [(5.1, 5.9)], optimizer_end=5.95, publish=(5.95, 6.0))
    out += s3
    out.append(span("weights.broadcast", 6.0, 6.5, "0" * 32, links=[p3], **{"rl.policy_version": 3}))
    out.append(
        span("weights.load", 6.1, 6.6, "0" * 32, links=[p3], **{"rl.policy_version": 3, "weights.member_id": "e1"})
    )
    return out


def test_breakdown_of_hand_made_spans(spans) -> None:
    rows = {r.group_id: r for r in breakdown(spans)}
    assert list(rows) == ["B", "A", "C", "D"]  # by ticket start, then put start
    a, b, c, d = rows["A"], rows["B"], rows["C"], rows["D"]
    assert (a.generate, a.score, b.score) == pytest.approx((1.0, 0.5, 0.2))
    assert a.step == 0 and a.policy_version == 1 and c.step == 1  # the committed step, not the redelivery
    assert a.queue_wait == pytest.approx(0.4) and b.queue_wait == pytest.approx(0.1)  # put end -> its Get's end
    assert a.train == pytest.approx(1.0) and a.publish == pytest.approx(0.2)
    assert a.broadcast == pytest.approx(0.8)
    assert a.load == pytest.approx(1.2)  # the slowest engine
    assert a.total == pytest.approx(4.5)  # rollout start -> the last engine serves weights trained on it
    # C's version was superseded and its own broadcast failed: the first newer broadcast delivered it.
    assert c.queue_wait == pytest.approx(0.4) and c.train == pytest.approx(1.0)
    assert c.broadcast == pytest.approx(0.5) and c.load == pytest.approx(0.5) and c.total == pytest.approx(4.6)
    assert d.step is None and d.queue_wait is None and d.total is None and d.generate == pytest.approx(1.0)

    stats = {s.phase: s for s in phase_stats(list(rows.values()))}
    assert stats["generate"].n == 4 and stats["generate"].median == pytest.approx(1.0)
    assert stats["queue_wait"].n == 3
    assert (stats["queue_wait"].median, stats["queue_wait"].p90) == pytest.approx((0.4, 0.4))
    assert stats["score"].median == pytest.approx(0.375)  # (0.25 + 0.5) / 2 of [0.2, 0.25, 0.5, 0.5]
    # totals: A and B (same step) 4.5, C 4.6
    assert (stats["total"].median, stats["total"].p90) == pytest.approx((4.5, 4.58))
    assert stats["load"].mean == pytest.approx((1.2 + 1.2 + 0.5) / 3)


def test_quantile_interpolates_like_numpy() -> None:
    values = [3.0, 1.0, 2.0, 10.0]
    assert quantile(values, 0.5) == 2.5 and quantile(values, 0.9) == pytest.approx(7.9)
    assert quantile([5.0], 0.9) == 5.0 and math.isnan(quantile([], 0.5))


def test_the_trace_command_prints_the_table_and_writes_the_png(spans, tmp_path, capsys) -> None:
    from tauflow.controller.cli import main

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lines = [json.dumps(s) for s in spans]
    (run_dir / "traces.jsonl").write_text("\n".join(lines) + '\n{"name": "torn li')  # a torn last line is skipped
    assert load_spans(run_dir) == spans
    assert main(["trace", str(run_dir), "--json", str(tmp_path / "out.json")]) == 0
    out = capsys.readouterr().out
    assert "4 groups traced, 3 trained" in out
    row = next(line for line in out.splitlines() if line.startswith("queue_wait"))
    assert row.split() == ["queue_wait", "3", "0.4000", "0.4000", "0.3000"]
    assert (run_dir / "traces.png").stat().st_size > 5_000
    assert json.loads((tmp_path / "out.json").read_text())["groups"][0]["group_id"] == "B"
    assert main(["trace", str(tmp_path / "missing")]) == 2
    # not a traces_file (the run's summary.json, a number, lines that are not JSON): said, not a traceback
    for i, text in enumerate(('{"status": "completed", "steps": []}', "5", "[1, 2]", "{bad\n{worse")):
        wrong = tmp_path / f"wrong{i}.json"
        wrong.write_text(text)
        assert main(["trace", str(wrong)]) == 2
        assert "holds no spans" in " ".join(capsys.readouterr().err.split())


def test_the_run_sets_every_service_to_write_spans_to_its_traces_file(tmp_path, monkeypatch) -> None:
    from tauflow.controller.app import build_run
    from tauflow.controller.config import RunConfig

    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    base = {"model": "m", "dataset": "d", "steps": 1, "out_dir": str(tmp_path / "run")}
    assert build_run(RunConfig(**base)).trace_env() == {}
    (tmp_path / "run").mkdir(exist_ok=True)
    (tmp_path / "run" / "traces.jsonl").write_text("old run\n")
    run = build_run(RunConfig(**base, traces_file="traces.jsonl"))
    env = run.trace_env()
    assert env == {
        "OTEL_TRACES_EXPORTER": "file",
        "TAUFLOW_TRACES_FILE": str((tmp_path / "run" / "traces.jsonl").resolve()),
    }
    assert (tmp_path / "run" / "traces.jsonl.prev").read_text() == "old run\n"  # a new run starts a new file
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
    assert run.trace_env()["OTEL_TRACES_EXPORTER"] == "otlp,file"  # the collector keeps getting them
    assert Path(env["TAUFLOW_TRACES_FILE"]).parent.is_dir()


def test_an_engine_that_joined_later_does_not_stretch_the_groups_before_it(spans) -> None:
    # tauflow scale rollout 2 mid-run: the new engine's first load (version 3, at 10 s) is "the first newer
    # version it loaded" for versions 1 and 2 too; `total` was 41 s where the phases summed to 1 s
    joined = span("weights.load", 9.0, 10.0, "0" * 32, **{"rl.policy_version": 3, "weights.member_id": "e3"})
    rows = {r.group_id: r for r in breakdown([*spans, joined])}
    assert rows["A"].total == pytest.approx(4.5) and rows["A"].load == pytest.approx(1.2)
    assert rows["C"].total == pytest.approx(4.6)
