"""tauflow's side of the sglang engine, against ``FakeSGLangServer`` (a FAKE that records the calls; SGLang
itself needs a GPU): what each /generate asks, how answers become completions with per-token versions, the
safe-point swap (pause, update from tensors, continue) in retract mode and in abort mode (resumed segments),
refused weights and requests, a failed update, cancellation and shutdown."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tauflow.rollout.engine import (
    EngineClosedError,
    EngineState,
    FinishReason,
    InvalidRequestError,
    SamplingParams,
    WeightUpdateError,
    engine_class,
)
from tauflow.rollout.engine.sglang import SGLangEngine, SGLangError, sample_seed

from .fake_sglang import FakeSGLangServer

PROMPTS = [[1, 5, 6, 7], [1, 3]]


def expected_tokens(last: int, versions: list[int], vocab: int = 16) -> list[int]:
    """The fake's tokens after ``last``, one per version."""
    out = []
    for v in versions:
        last = (3 * last + 1 + v) % vocab
        out.append(last)
    return out


def generates(fake: FakeSGLangServer) -> list[Any]:
    return [body for route, body in fake.calls if route == "/generate"]


@pytest.fixture
def fake() -> Iterator[FakeSGLangServer]:
    with FakeSGLangServer() as server:
        yield server


@pytest.fixture
def engine(fake: FakeSGLangServer, model_dir: Path) -> Iterator[SGLangEngine]:
    eng = SGLangEngine.from_pretrained(model_dir, base_url=fake.url, seed=5, ipc_device=None)
    yield eng
    eng.close()


def wait_for(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def test_generate_asks_per_sample_and_maps_the_answers(engine: SGLangEngine, fake: FakeSGLangServer) -> None:
    assert fake.calls[:2] == [
        ("/get_server_info", {}),
        ("/update_weight_version", {"new_version": "0", "abort_all_requests": False}),
    ]
    params = SamplingParams(max_new_tokens=6, n=3, temperature=0.7, top_p=0.9, ignore_eos=True, seed=40)
    out = engine.submit(PROMPTS, params).result(30)
    assert [len(group) for group in out] == [3, 3]
    for prompt, group in zip(PROMPTS, out, strict=True):
        for c in group:
            assert c.token_ids == expected_tokens(prompt[-1], [0] * 6)
            assert c.logprobs == [-0.1] * 6 and c.versions == [0] * 6
            assert c.finish_reason is FinishReason.LENGTH
    bodies = generates(fake)
    assert len(bodies) == 6  # one per sample: n is never sent, each sample has its own seed stream
    assert sorted((tuple(b["input_ids"]), b["sampling_params"]["sampling_seed"]) for b in bodies) == sorted(
        (tuple(p), sample_seed(40, j)) for p in PROMPTS for j in range(3)
    )  # sample j of every prompt draws from the stream (seed, j)
    sp = bodies[0]["sampling_params"]
    assert sp["temperature"] == 0.7 and sp["top_p"] == 0.9 and sp["top_k"] == -1 and sp["ignore_eos"] is True
    assert bodies[0]["return_logprob"] is True and bodies[0]["stream"] is False
    assert engine.stats().counters["sequences"] == 6
    engine.submit([[1]], SamplingParams(max_new_tokens=2, top_k=1, temperature=0.7)).result(30)
    greedy = generates(fake)[-1]["sampling_params"]
    assert greedy["temperature"] == 0.0 and "sampling_seed" not in greedy  # top_k 1 is greedy; no seed: none sent


def test_sample_streams_do_not_collide_across_seeds() -> None:
    streams = {sample_seed(seed, j) for seed in range(64) for j in range(16)}
    assert len(streams) == 64 * 16 and all(0 <= s < 1 << 63 for s in streams)


def test_eos_and_stop_tokens_end_completions_and_are_kept(engine: SGLangEngine, fake: FakeSGLangServer) -> None:
    # from 5: 0, 1, 4, 13, 8, 9, 12, 5, ...; from 3: 10, 15, 14, 11, 2 (EOS)
    (stop_at_4,), (eos,) = engine.submit([[5], [3]], SamplingParams(max_new_tokens=12, stop_token_ids=(4,))).result(30)
    assert stop_at_4.token_ids == [0, 1, 4] and stop_at_4.finish_reason is FinishReason.STOP
    assert eos.token_ids == [10, 15, 14, 11, 2] and eos.finish_reason is FinishReason.STOP
    assert generates(fake)[0]["sampling_params"]["stop_token_ids"] == [4]


def _swap_mid_generation(engine: SGLangEngine, fake: FakeSGLangServer, make_model: Any) -> list[Any]:
    fake.token_delay_s = 0.01
    params = SamplingParams(max_new_tokens=20, n=2, ignore_eos=True, seed=1)
    future = engine.submit(PROMPTS, params)
    wait_for(lambda: len(generates(fake)) == 4)
    time.sleep(0.05)  # a few tokens in
    new = make_model(seed=1).state_dict()
    assert engine.stage_weights(1, new).result(30) == 1
    assert engine.policy_version == 1
    out = future.result(30)
    record = fake.loaded[0]
    assert record["weight_version"] == "1"
    assert [(n, shape, dtype) for n, shape, dtype, _ in record["rank0"]] == [
        (n, tuple(t.shape), "float32") for n, t in new.items()
    ]
    assert [s for *_, s in record["rank0"]] == pytest.approx([float(t.sum()) for t in new.values()])
    for prompt, group in zip(PROMPTS, out, strict=True):
        for c in group:
            assert c.finish_reason is FinishReason.LENGTH and len(c.token_ids) == 20  # nothing was lost
            switch = c.versions.index(1)
            assert 0 < switch < 20 and c.versions == [0] * switch + [1] * (20 - switch)
            assert c.token_ids == expected_tokens(prompt[-1], c.versions)
            assert c.logprobs == [-0.1] * switch + [-0.2] * (20 - switch)
    return out


def test_a_swap_in_retract_mode_keeps_requests_running_and_versions_per_token(
    engine: SGLangEngine, fake: FakeSGLangServer, make_model: Any
) -> None:
    _swap_mid_generation(engine, fake, make_model)
    swap = [(r, b) for r, b in fake.calls if r not in ("/generate", "/get_server_info", "/update_weight_version")]
    assert [r for r, _ in swap] == [
        "/pause_generation",
        "/begin_weight_update",
        "/update_weights_from_tensor",
        "/end_weight_update",
        "/continue_generation",
    ]
    assert swap[0][1] == {"mode": "retract"} and fake.loaded[0]["paused"] == "retract"
    assert swap[2][1]["flush_cache"] is True and swap[2][1]["abort_all_requests"] is False
    assert len(generates(fake)) == 4  # retracted, not aborted: no request was sent twice


def test_a_swap_in_abort_mode_resumes_the_aborted_requests(model_dir: Path, make_model: Any) -> None:
    with FakeSGLangServer(version="0.5.10") as fake:  # no retract mode, no spans, no update session
        engine = SGLangEngine.from_pretrained(model_dir, base_url=fake.url, ipc_device=None)
        try:
            _swap_mid_generation(engine, fake, make_model)
            routes = [r for r in fake.routes() if r not in ("/generate", "/get_server_info", "/update_weight_version")]
            assert routes == ["/pause_generation", "/update_weights_from_tensor", "/continue_generation"]
            assert fake.calls[[r for r, _ in fake.calls].index("/pause_generation")][1] == {"mode": "abort"}
            bodies = generates(fake)
            assert len(bodies) == 8  # every sample was aborted once and resumed once
            for b in bodies[4:]:
                first = next(x for x in bodies[:4] if x["rid"] == b["rid"].rsplit("-", 1)[0] + "-0")
                done = len(b["input_ids"]) - len(first["input_ids"])
                assert b["input_ids"][: len(first["input_ids"])] == first["input_ids"] and done > 0
                assert b["sampling_params"]["max_new_tokens"] == 20 - done
            assert engine.stats().counters["resumed_segments"] == 4
        finally:
            engine.close()


def test_bad_weights_are_refused_at_once_and_nothing_is_sent(
    engine: SGLangEngine, fake: FakeSGLangServer, make_model: Any
) -> None:
    good = make_model(seed=1).state_dict()
    before = len(fake.calls)
    with pytest.raises(WeightUpdateError, match="unknown weight name"):
        engine.stage_weights(1, {**good, "extra.weight": good["lm_head.weight"]})
    name = "model.embed_tokens.weight"
    with pytest.raises(WeightUpdateError, match="shape"):
        engine.stage_weights(1, {**good, name: good[name][:, :8]})
    with pytest.raises(WeightUpdateError, match="not newer"):
        engine.stage_weights(0, good)
    with pytest.raises(WeightUpdateError, match="non-finite"):
        engine.stage_weights(1, {name: good[name] * float("nan")})
    time.sleep(0.05)
    assert len(fake.calls) == before and engine.policy_version == 0


def test_a_failed_update_closes_its_update_session_so_the_next_version_loads(
    engine: SGLangEngine, fake: FakeSGLangServer, make_model: Any
) -> None:
    assert fake.session_required  # SGLang >= 0.5.21: a second begin_weight_update is refused while one is open
    fake.fail_next_update = "bad weights"
    with pytest.raises(SGLangError, match="bad weights"):
        engine.stage_weights(1, make_model(seed=1).state_dict()).result(30)
    assert engine.stage_weights(2, make_model(seed=2).state_dict()).result(30) == 2
    assert [r for r in fake.routes() if "weight_update" in r] == ["/begin_weight_update", "/end_weight_update"] * 2


def test_servers_the_engine_cannot_drive_are_refused_at_start(model_dir: Path) -> None:
    with FakeSGLangServer(version="0.5.2") as old, pytest.raises(SGLangError, match=r"needs SGLang >= 0\.5\.6"):
        SGLangEngine.from_pretrained(model_dir, base_url=old.url)
    with FakeSGLangServer(tp_size=2) as sharded, pytest.raises(SGLangError, match="tp-size 1"):
        SGLangEngine.from_pretrained(model_dir, base_url=sharded.url)


def test_a_failed_update_fails_its_version_and_generation_goes_on(
    engine: SGLangEngine, fake: FakeSGLangServer, make_model: Any
) -> None:
    fake.fail_next_update = "out of memory while loading"
    with pytest.raises(SGLangError, match="out of memory while loading"):
        engine.stage_weights(1, make_model(seed=1).state_dict()).result(30)
    assert fake.routes()[-1] == "/continue_generation"  # not left paused
    assert engine.policy_version == 0 and "out of memory" in engine.stats().last_error
    (c,), _ = engine.submit(PROMPTS, SamplingParams(max_new_tokens=3, ignore_eos=True)).result(30)
    assert c.versions == [0, 0, 0]
    assert engine.stage_weights(2, make_model(seed=2).state_dict()).result(30) == 2  # a later version loads


def test_a_rebase_drops_what_was_staged_after_it(engine: SGLangEngine, fake: FakeSGLangServer, make_model: Any) -> None:
    fake.token_delay_s = 0.01
    weights = [make_model(seed=s).state_dict() for s in (1, 2, 3)]
    engine.submit([[1]], SamplingParams(max_new_tokens=30, ignore_eos=True))
    wait_for(lambda: generates(fake))
    fake.update_gate = threading.Event()  # version 3's update stays in flight until the re-base is staged
    first = engine.stage_weights(3, weights[0])
    wait_for(lambda: "/update_weights_from_tensor" in fake.routes())
    second = engine.stage_weights(4, weights[1])
    rebased = engine.stage_broadcast(2, weights[2])  # at or below the newest: a re-base
    fake.update_gate.set()
    assert rebased.result(30) == 2 and engine.policy_version == 2
    assert second.cancelled()
    assert first.done()
    assert [r["weight_version"] for r in fake.loaded][-1] == "2"


def test_requests_the_engine_cannot_serve_are_refused_at_once(engine: SGLangEngine, fake: FakeSGLangServer) -> None:
    before = len(fake.calls)
    with pytest.raises(InvalidRequestError, match="ignore_eos"):
        engine.submit(PROMPTS, SamplingParams(ignore_eos=True, stop_token_ids=(3,)))
    with pytest.raises(InvalidRequestError, match="outside"):
        engine.submit([[1, 99]], SamplingParams())
    with pytest.raises(InvalidRequestError, match="context"):
        engine.submit([[1] * 60], SamplingParams(max_new_tokens=10))
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.submit([[]], SamplingParams())
    with pytest.raises(InvalidRequestError, match="text prompts only"):
        engine.submit([[1]], SamplingParams(), media=[{"pixel_values": None}])  # type: ignore[dict-item]
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        engine.submit([[1]], SamplingParams(stop=("x",)))
    assert len(fake.calls) == before


def test_cancelling_a_request_aborts_it_on_the_server(engine: SGLangEngine, fake: FakeSGLangServer) -> None:
    fake.token_delay_s = 0.01
    future = engine.submit([[1, 4]], SamplingParams(max_new_tokens=60, n=2, ignore_eos=True))
    wait_for(lambda: len(generates(fake)) == 2)
    assert future.cancel()
    wait_for(lambda: len([b for r, b in fake.calls if r == "/abort_request"]) == 2)
    aborted = {b["rid"] for r, b in fake.calls if r == "/abort_request"}
    assert {b["rid"] for b in generates(fake)} == aborted  # the exact rids sent: SGLang ignores any other
    (c,), = engine.submit([[1]], SamplingParams(max_new_tokens=2, ignore_eos=True)).result(30)  # fmt: skip
    assert len(c.token_ids) == 2


def test_close_answers_in_flight_requests_with_what_they_have(model_dir: Path) -> None:
    with FakeSGLangServer(token_delay_s=0.01) as fake:
        engine = SGLangEngine.from_pretrained(model_dir, base_url=fake.url, ipc_device=None)
        future = engine.submit(PROMPTS, SamplingParams(max_new_tokens=60, ignore_eos=True))
        wait_for(lambda: len(generates(fake)) == 2)
        time.sleep(0.05)
        engine.close()
        for (c,) in future.result(5):
            assert c.finish_reason is FinishReason.ABORT and 0 < len(c.token_ids) < 60
            assert len(c.versions) == len(c.logprobs) == len(c.token_ids)
        assert ("/abort_request", {"rid": "", "abort_all": True}) in fake.calls
        with pytest.raises(EngineClosedError):
            engine.submit(PROMPTS, SamplingParams())
        with pytest.raises(EngineClosedError):
            engine.stage_weights(1, {})


def test_the_backend_loads_by_name_and_an_unreachable_server_is_an_error(model_dir: Path) -> None:
    assert engine_class("sglang") is SGLangEngine
    with pytest.raises(SGLangError, match="get_server_info"):
        SGLangEngine.from_pretrained(model_dir, base_url="http://127.0.0.1:9", control_timeout_s=2.0)


def test_a_rollout_server_with_the_sglang_backend_serves_generate(model_dir: Path, tmp_path: Path) -> None:
    """The rollout service as its own process, built with ``engine: sglang`` on the fake server's URL."""
    import grpc

    from tauflow.api.common.v1 import common_pb2
    from tauflow.api.rollout.v1 import rollout_pb2, rollout_pb2_grpc
    from tauflow.core.testing import ServiceProcess

    with FakeSGLangServer() as fake:
        settings = {"model_path": str(model_dir), "engine": "sglang", "engine_options.base_url": fake.url}
        server = ServiceProcess("rollout", tmp_path, settings).start(timeout_s=60)
        try:
            stub = rollout_pb2_grpc.RolloutServiceStub(grpc.insecure_channel(server.address))
            sampling = rollout_pb2.SamplingParams(max_new_tokens=5, n=2, ignore_eos=True)
            reply = stub.Generate(rollout_pb2.GenerateRequest(prompt_token_ids=[1, 5], sampling=sampling), timeout=30)
            assert len(reply.samples) == 2
            for s in reply.samples:
                assert list(s.completion_token_ids) == expected_tokens(5, [0] * 5)
                assert list(s.behaviour_logprobs) == pytest.approx([-0.1] * 5)
                assert list(s.token_versions) == [0] * 5 and s.finish_reason == common_pb2.FINISH_REASON_LENGTH
            (status,) = stub.GetStatus(rollout_pb2.GetStatusRequest(), timeout=10).engines
            assert status.backend == "sglang" and status.engine_id == "rollout-0-sglang"
            # the server refuses the request itself: INVALID_ARGUMENT with its reason (asking again gets the
            # same answer; UNAVAILABLE had callers retry it), asked once, and the service serves on
            asked = len(generates(fake))
            fake.answer_hook = lambda route, code, body: (
                (400, {"error": {"message": "the input is longer than the context length"}})
                if route == "/generate"
                else (code, body)
            )
            with pytest.raises(grpc.RpcError) as refused:
                stub.Generate(rollout_pb2.GenerateRequest(prompt_token_ids=[1, 5], sampling=sampling), timeout=30)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "refused the request" in refused.value.details() and "context length" in refused.value.details()
            assert len(generates(fake)) - asked <= 2  # one ask per sample, none again
            fake.answer_hook = None
            assert (
                len(
                    stub.Generate(
                        rollout_pb2.GenerateRequest(prompt_token_ids=[1, 5], sampling=sampling), timeout=30
                    ).samples
                )
                == 2
            )
            # the server restarts without the weights: refused, UNAVAILABLE (was UNKNOWN), and the service ends,
            # non-zero, for its launcher to restart it (it answered UNAVAILABLE for good)
            fake.weight_version = "default"
            with pytest.raises(grpc.RpcError) as refused:
                stub.Generate(rollout_pb2.GenerateRequest(prompt_token_ids=[1, 5], sampling=sampling), timeout=30)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert server.proc is not None and server.proc.wait(30) != 0
            assert "stopped serving" in server.log_text()
        finally:
            server.stop()


# -- taking turns in memory (colocated mode) -----------------------------------------------------------------------
# The fake crashes, as SGLang does, on any memory call out of turn (a release of a busy server, twice, a resume of
# what is not released, a generate or an update on released memory): each test ends asserting it never did.


def _memory_calls(fake: FakeSGLangServer) -> list[tuple[str, Any]]:
    return [(r, b.get("tags")) for r, b in fake.calls if r.endswith("_memory_occupation")]


def colocated_engine(fake: FakeSGLangServer, model_dir: Path, **options: Any) -> SGLangEngine:
    options.setdefault("offload_weights_when_idle", True)
    options.setdefault("release_after_idle_s", 0.01)
    return SGLangEngine.from_pretrained(model_dir, base_url=fake.url, ipc_device=None, **options)


def serve_until_the_release_is_held(engine: SGLangEngine, fake: FakeSGLangServer) -> None:
    """One request served, then wait for the engine's release, which the fake holds at its gate."""
    engine.submit(PROMPTS[:1], SamplingParams(max_new_tokens=2, seed=1)).result(10)
    wait_for(lambda: "/release_memory_occupation" in fake.routes())


def test_an_idle_engine_releases_the_servers_memory_and_takes_it_back_in_turn(
    fake: FakeSGLangServer, model_dir: Path, make_model: Any
) -> None:
    engine = colocated_engine(fake, model_dir)
    try:
        engine.submit(PROMPTS[:1], SamplingParams(max_new_tokens=3, seed=1)).result(10)
        wait_for(lambda: engine.counters["weight_offloads"] == 1)
        assert fake.released == {"weights", "kv_cache"} and engine.counters["memory_releases"] == 1
        assert _memory_calls(fake) == [("/release_memory_occupation", ["weights", "kv_cache"])]
        assert fake.routes()[-2:] == ["/flush_cache", "/release_memory_occupation"]  # (idle, the server says)

        # a version arriving meanwhile: the weights come back first, the KV cache with the next request
        assert engine.stage_weights(1, make_model(seed=1).state_dict()).result(10) == 1
        assert fake.released == {"kv_cache"}
        assert _memory_calls(fake)[-1] == ("/resume_memory_occupation", ["weights"])
        routes = fake.routes()
        assert routes.index("/resume_memory_occupation") < routes.index("/update_weights_from_tensor")
        time.sleep(0.1)  # after a weight update alone, nothing is released again: requests come next
        assert len(_memory_calls(fake)) == 2

        c = engine.submit(PROMPTS[:1], SamplingParams(max_new_tokens=3, seed=1)).result(10)[0][0]
        assert c.versions == [1, 1, 1] and c.token_ids == expected_tokens(PROMPTS[0][-1], [1, 1, 1])
        assert _memory_calls(fake)[2] == ("/resume_memory_occupation", ["kv_cache"])
        wait_for(lambda: engine.counters["weight_offloads"] == 2)  # and idle again: released again
    finally:
        engine.close()
    assert fake.crashed == ""
    assert fake.released == set()  # closing leaves a server it did not start whole


def test_a_request_or_a_version_arriving_during_a_release_waits_for_it_and_resumes(
    fake: FakeSGLangServer, model_dir: Path, make_model: Any
) -> None:
    engine = colocated_engine(fake, model_dir)
    gate = fake.gates["/release_memory_occupation"] = threading.Event()
    try:
        serve_until_the_release_is_held(engine, fake)
        request = engine.submit(PROMPTS[:1], SamplingParams(max_new_tokens=2, seed=1))
        version = engine.stage_weights(1, make_model(seed=1).state_dict())
        time.sleep(0.1)
        assert fake.routes()[-1] == "/release_memory_occupation"  # nothing sent while it is under way
        gate.set()
        assert request.result(10) and version.result(10) == 1
        assert fake.routes().count("/resume_memory_occupation") >= 1
    finally:
        gate.set()
        engine.close()
    assert fake.crashed == ""


def test_closing_during_a_hung_release_returns_in_time_and_resolves_every_request(
    fake: FakeSGLangServer, model_dir: Path
) -> None:
    engine = colocated_engine(fake, model_dir)
    gate = fake.gates["/release_memory_occupation"] = threading.Event()
    try:
        serve_until_the_release_is_held(engine, fake)
        waiting = engine.submit(PROMPTS[:1], SamplingParams(max_new_tokens=2, seed=1))
        started = time.monotonic()
        engine.close(timeout=2.0)
        assert time.monotonic() - started < 10
        assert waiting.done()  # (cancelled: nobody waits on a stopped engine)
    finally:
        gate.set()
    assert fake.crashed == ""


def test_a_request_cancelled_while_the_memory_comes_back_leaves_the_record_true(
    fake: FakeSGLangServer, model_dir: Path
) -> None:
    engine = colocated_engine(fake, model_dir)
    gate = fake.gates["/resume_memory_occupation"] = threading.Event()
    try:
        engine.submit(PROMPTS[:1], SamplingParams(max_new_tokens=2, seed=1)).result(10)
        wait_for(lambda: engine.counters["weight_offloads"] == 1)
        cancelled = engine.submit(PROMPTS[:1], SamplingParams(max_new_tokens=2, seed=1))
        wait_for(lambda: "/resume_memory_occupation" in fake.routes())  # held by the fake
        cancelled.cancel()
        gate.set()
        wait_for(lambda: fake.released == set() or engine.counters["weight_offloads"] == 2)
        # the record followed the server: the next request resumes nothing twice, and the idle engine releases
        assert engine.submit(PROMPTS[:1], SamplingParams(max_new_tokens=2, seed=1)).result(10)
        wait_for(lambda: engine.counters["weight_offloads"] >= 2)
    finally:
        gate.set()
        engine.close()
    assert fake.crashed == ""


def test_a_server_still_busy_with_what_was_cancelled_is_released_only_once_it_is_idle(
    fake: FakeSGLangServer, model_dir: Path
) -> None:
    import json
    import urllib.request

    # another client's request runs on the server (as a cancelled one runs until its abort lands)
    body = json.dumps({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 100, "ignore_eos": True}})
    outside = threading.Thread(
        target=lambda: urllib.request.urlopen(
            urllib.request.Request(fake.url + "/generate", body.encode(), {"Content-Type": "application/json"}),
            timeout=30,
        ).read()
    )
    engine = colocated_engine(fake, model_dir, offload_weights_when_idle=False, release_memory_when_idle=True)
    try:
        outside.start()
        wait_for(lambda: "/generate" in fake.routes())
        engine.submit(PROMPTS[:1], SamplingParams(max_new_tokens=2, seed=1)).result(10)
        wait_for(lambda: fake.routes().count("/flush_cache") >= 2)  # asked, refused, asked again later
        assert "/release_memory_occupation" not in fake.routes()
        outside.join(30)
        wait_for(lambda: engine.counters["memory_releases"] == 1)
        assert fake.released == {"kv_cache"} and engine.counters["weight_offloads"] == 0
    finally:
        engine.close()
    assert fake.crashed == ""

    # a gap shorter than release_after_idle_s costs nothing
    patient = colocated_engine(fake, model_dir, release_after_idle_s=60)
    try:
        before = len(fake.calls)
        for seed in range(3):
            patient.submit(PROMPTS[:1], SamplingParams(max_new_tokens=2, seed=seed)).result(10)
        assert not any(r in ("/flush_cache", "/release_memory_occupation") for r in fake.routes()[before:])
    finally:
        patient.close()


def test_a_server_the_engine_starts_for_colocated_mode_can_release_its_memory(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tauflow.rollout.engine.sglang as sglang_module

    launched: list[tuple[list[str], dict[str, str] | None]] = []

    def popen(command: list[str], *args: Any, env: dict[str, str] | None = None, **kwargs: Any) -> Any:
        launched.append((command, env))
        raise RuntimeError("recorded")

    monkeypatch.setattr(sglang_module.subprocess, "Popen", popen)
    for options, flags in (
        ({}, set()),
        ({"release_memory_when_idle": True}, {"--enable-memory-saver"}),
        ({"offload_weights_when_idle": True}, {"--enable-memory-saver", "--enable-weights-cpu-backup"}),
        ({"release_memory_when_idle": True, "release_cuda_graphs_when_idle": True}, {"--enable-memory-saver"}),
    ):
        with pytest.raises(RuntimeError, match="recorded"):
            SGLangEngine.from_pretrained(model_dir, **options)
        command, env = launched[-1]
        assert {a for a in command if a.startswith("--enable-")} == flags
        # (the CUDA graphs are captured where they can be released only when the server's environment says so)
        assert (env or {}).get("SGLANG_MEMORY_SAVER_CUDA_GRAPH") == (
            "true" if options.get("release_cuda_graphs_when_idle") else None
        )
    with pytest.raises(ValueError, match="release_after_idle_s"):
        SGLangEngine("http://127.0.0.1:9", {}, vocab_size=16, release_after_idle_s=-1)
    with pytest.raises(ValueError, match="release_cuda_graphs_when_idle goes with"):
        SGLangEngine("http://127.0.0.1:9", {}, vocab_size=16, release_cuda_graphs_when_idle=True)

    class Server:  # a server that started: the engine then refuses its options, and stops it
        terminated = False

        def poll(self) -> int | None:
            return 0 if self.terminated else None

        def terminate(self) -> None:
            self.terminated = True

        def wait(self, timeout: float) -> int:
            return 0

    server = Server()
    monkeypatch.setattr(sglang_module.subprocess, "Popen", lambda *a, **k: server)
    monkeypatch.setattr(sglang_module, "_wait_until_healthy", lambda *a: None)
    with pytest.raises(ValueError, match="release_cuda_graphs_when_idle goes with"):
        SGLangEngine.from_pretrained(model_dir, release_cuda_graphs_when_idle=True)
    assert server.terminated


def test_an_idle_engine_releases_the_cuda_graphs_too_and_takes_them_back_before_generating(
    fake: FakeSGLangServer, model_dir: Path, make_model: Any
) -> None:
    # the KV cache and the CUDA graphs (the weights stay): released when idle, back before the next request;
    # a weight update meanwhile needs neither
    engine = colocated_engine(fake, model_dir, offload_weights_when_idle=False, release_memory_when_idle=True,
                              release_cuda_graphs_when_idle=True)  # fmt: skip
    try:
        engine.submit(PROMPTS[:1], SamplingParams(max_new_tokens=2, seed=1)).result(10)
        wait_for(lambda: engine.counters["memory_releases"] == 1)
        assert _memory_calls(fake) == [("/release_memory_occupation", ["cuda_graph", "kv_cache"])]
        assert engine.stage_weights(1, make_model(seed=1).state_dict()).result(10) == 1
        assert len(_memory_calls(fake)) == 1 and fake.released == {"cuda_graph", "kv_cache"}
        c = engine.submit(PROMPTS[:1], SamplingParams(max_new_tokens=2, seed=1)).result(10)[0][0]
        assert c.versions == [1, 1]
        assert _memory_calls(fake)[1] == ("/resume_memory_occupation", ["cuda_graph", "kv_cache"])
    finally:
        engine.close()
    assert fake.crashed == ""


# -- a server that misbehaves (the sglang engine's data must never be wrong, its calls never endless) -----------------


@pytest.mark.parametrize("label", ["default", "0"])
def test_a_server_that_restarted_without_the_weights_is_refused_and_the_engine_stops_serving(
    engine: SGLangEngine, fake: FakeSGLangServer, make_model: Any, label: str
) -> None:
    # Restarted, a server serves its checkpoint under "default" (or its start version): its tokens were labelled
    # with the engine's version and 61 such groups passed the queue's checks as the policy's.
    assert engine.stage_weights(1, make_model(seed=1).state_dict()).result(30) == 1
    fake.weight_version = label
    with pytest.raises(SGLangError, match=f"names weight version '{label}', not 1"):
        engine.submit(PROMPTS[:1], SamplingParams(max_new_tokens=3, ignore_eos=True)).result(30)
    stats = engine.stats()
    assert stats.state == EngineState.FAILED and "restarted or lost its weights" in stats.last_error
    with pytest.raises(SGLangError, match="serves no more"):  # (its restart attaches afresh and loads them)
        engine.submit(PROMPTS[:1], SamplingParams(max_new_tokens=3))


@pytest.mark.parametrize(
    "answer",
    [None, "Success", {"status": "error"}, {"message": "loaded"}],
    ids=["empty", "text", "status-error", "no-success"],
)
def test_a_weight_update_the_server_does_not_confirm_is_not_published(
    engine: SGLangEngine, fake: FakeSGLangServer, make_model: Any, answer: Any
) -> None:
    fake.answer_hook = lambda route, status, body: (
        (200, answer) if route == "/update_weights_from_tensor" else (status, body)
    )
    with pytest.raises(SGLangError, match="did not confirm"):
        engine.stage_weights(1, make_model(seed=1).state_dict()).result(30)
    assert engine.policy_version == 0


def test_a_redirect_or_a_busy_answer_is_no_success_and_busy_is_asked_again(
    engine: SGLangEngine, fake: FakeSGLangServer, make_model: Any
) -> None:
    fake.answer_hook = lambda route, status, body: (
        (302, None) if route == "/update_weights_from_tensor" else (status, body)
    )
    with pytest.raises(SGLangError, match="HTTP 302"):
        engine.stage_weights(1, make_model(seed=1).state_dict()).result(30)
    assert engine.policy_version == 0
    fake.weight_version = "0"  # (this fake loaded it all the same; a server that redirected did not)
    busy = iter([429, 503])  # (the first such answer ended the rollout)

    def twice_busy(route: str, status: int, body: Any) -> tuple[int, Any]:
        code = next(busy, None) if route == "/generate" else None
        return (code, {"error": {"message": "no room"}}) if code else (status, body)

    fake.answer_hook = twice_busy
    (c,), _ = engine.submit(PROMPTS, SamplingParams(max_new_tokens=3, ignore_eos=True)).result(30)
    assert c.versions == [0, 0, 0] and len(c.token_ids) == 3
    rids = [body["rid"] for body in generates(fake)[-4:]]
    assert len(set(rids)) == 4  # (each ask its own rid: an abort names the one that runs)


def _edited(change: Callable[[dict[str, Any]], None]) -> Callable[[str, int, Any], tuple[int, Any]]:
    def hook(route: str, status: int, body: Any) -> tuple[int, Any]:
        if route == "/generate" and status == 200:
            change(body["meta_info"])
        return status, body

    return hook


def _entry(k: int, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(meta: dict[str, Any]) -> None:
        meta["output_token_logprobs"][0][k] = value

    return change


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        (_entry(1, 10**9), "not in the vocabulary"),
        (_entry(1, -1), "not in the vocabulary"),
        (_entry(1, 3.0), "not in the vocabulary"),
        (_entry(0, float("nan")), "not a log-probability"),
        (_entry(0, 0.5), "not a log-probability"),
        (_entry(0, "x"), "not a log-probability"),
        (lambda m: m["output_token_logprobs"].append([-0.1, 3, None]), "4 output tokens where at most 3"),
        (lambda m: m["output_token_logprobs"].__setitem__(0, 7), r"output_token_logprobs\[0\]"),
        (lambda m: m.__setitem__("finish_reason", "stop"), "finish_reason 'stop' is not an object"),
        (lambda m: m.__setitem__("weight_versions", [{"version": "0", "start": 0, "end": 2}]), "without a version"),
        (lambda m: m.__setitem__("weight_versions", [{"version": "42", "start": 0, "end": 3}]), "span"),
        (lambda m: m.__setitem__("weight_versions", "0"), "span"),
    ],
    ids=[
        "id-huge",
        "id-negative",
        "id-float",
        "lp-nan",
        "lp-positive",
        "lp-text",
        "too-many",
        "entry-shape",
        "finish-text",
        "spans-short",
        "span-unloaded",
        "spans-text",
    ],
)
def test_a_generation_answer_that_cannot_be_right_is_refused_naming_the_server(
    engine: SGLangEngine, fake: FakeSGLangServer, change: Callable[[dict[str, Any]], None], refusal: str
) -> None:
    fake.answer_hook = _edited(change)
    with pytest.raises(SGLangError, match=refusal) as refused:
        engine.submit(PROMPTS[:1], SamplingParams(max_new_tokens=3, ignore_eos=True)).result(30)
    assert engine.engine_id in str(refused.value) and fake.url in str(refused.value)
    assert engine.stats().state == EngineState.SERVING  # (one bad answer: its request fails, the engine serves)
    fake.answer_hook = None
    ((c,),) = engine.submit(PROMPTS[:1], SamplingParams(max_new_tokens=3, ignore_eos=True)).result(30)
    assert len(c.token_ids) == 3


def test_a_server_that_trickles_its_answer_is_cut_off_at_the_timeout_of_the_whole_call(
    fake: FakeSGLangServer, model_dir: Path
) -> None:
    # httpx's timeouts bound each read: a byte a second held a call (and a swap behind it) for good
    engine = SGLangEngine.from_pretrained(model_dir, base_url=fake.url, ipc_device=None, request_timeout_s=1.5)
    try:
        fake.trickle_s = 0.2
        started = time.monotonic()
        with pytest.raises(SGLangError, match="no whole answer within 1.5 s"):
            engine.submit(PROMPTS[:1], SamplingParams(max_new_tokens=3, ignore_eos=True)).result(30)
        assert time.monotonic() - started < 10
    finally:
        fake.trickle_s = 0.0
        engine.close()


def test_a_continue_the_server_never_takes_breaks_the_engine(
    engine: SGLangEngine, fake: FakeSGLangServer, make_model: Any
) -> None:
    # a server left paused served nothing while the engine said SERVING: every later request timed out
    fake.answer_hook = lambda route, status, body: (
        (500, {"error": {"message": "down"}}) if route == "/continue_generation" else (status, body)
    )
    with pytest.raises(SGLangError, match="continue_generation"):
        engine.stage_weights(1, make_model(seed=1).state_dict()).result(60)
    assert fake.routes().count("/continue_generation") == 3  # (asked three times)
    assert engine.stats().state == EngineState.FAILED
    with pytest.raises(SGLangError, match="serves no more"):
        engine.submit(PROMPTS[:1], SamplingParams(max_new_tokens=3))


def test_a_request_in_flight_across_a_rebase_completes_with_both_versions(
    engine: SGLangEngine, fake: FakeSGLangServer, make_model: Any
) -> None:
    # (the trainer resumed from an older checkpoint: the re-based version is below the one the request was sent
    # at, and its answer was refused as a version never loaded, failing every sample in flight)
    assert engine.stage_weights(3, make_model(seed=3).state_dict()).result(30) == 3
    fake.token_delay_s = 0.01
    running = engine.submit([[1]], SamplingParams(max_new_tokens=30, ignore_eos=True))
    wait_for(lambda: len(generates(fake)) >= 1)
    time.sleep(0.05)
    assert engine.stage_broadcast(2, make_model(seed=2).state_dict()).result(30) == 2
    ((c,),) = running.result(30)
    assert len(c.token_ids) == 30 and set(c.versions) <= {2, 3} and c.versions[-1] == 2


def test_a_refused_first_segment_is_the_requests_fault_and_a_refused_resumed_one_is_not(
    engine: SGLangEngine, fake: FakeSGLangServer
) -> None:
    import asyncio

    from tauflow.rollout.engine.sglang import SGLangRefusal, _Sample

    fake.answer_hook = lambda route, code, body: (
        (400, {"error": {"message": "longer than the context length"}}) if route == "/generate" else (code, body)
    )

    def segment(tokens_so_far: list[int]) -> Any:
        sample = _Sample([1, 5], "r", "r-0", list(tokens_so_far), [-0.1] * len(tokens_so_far), [0] * len(tokens_so_far))
        body = {"input_ids": [1, 5, *tokens_so_far], "sampling_params": {}, "rid": "r-0", "stream": False}
        return asyncio.run_coroutine_threadsafe(engine._generate_segment(sample, body), engine._loop).result(30)

    with pytest.raises(SGLangRefusal, match="refused the request"):
        segment([])  # the request as asked: INVALID_ARGUMENT at the service
    with pytest.raises(SGLangError) as resumed:  # the prompt and the tokens so far, after a swap: UNAVAILABLE
        segment([3, 4])
    assert not isinstance(resumed.value, InvalidRequestError)
    assert len(generates(fake)) == 2  # neither asked again
