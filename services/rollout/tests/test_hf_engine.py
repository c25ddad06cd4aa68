"""The hf engine on a tiny Qwen2 loaded with from_pretrained: log-probs against a full recomputation, batching,
stop tokens and lengths, greedy decoding, continuous batching, cancellation and shutdown."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tauflow.rollout.engine import (
    EngineClosedError,
    EngineState,
    FinishReason,
    InvalidRequestError,
    SamplingParams,
)
from tauflow.rollout.engine.hf import HFEngine

PROMPTS = [[1, 5, 6, 7], [1, 3], [1, 9, 10, 11, 12, 13, 14], [1, 4, 4]]  # different lengths: left padding at work


def _same(a: list[list[Any]], b: list[list[Any]]) -> bool:
    """Same completions: identical tokens, versions and finish reasons; log-probs equal up to float32 rounding
    (the rows of a batch are padded differently, so the matmuls round differently)."""
    assert [[(c.token_ids, c.versions, c.finish_reason) for c in g] for g in a] == [
        [(c.token_ids, c.versions, c.finish_reason) for c in g] for g in b
    ]
    for ga, gb in zip(a, b, strict=True):
        for ca, cb in zip(ga, gb, strict=True):
            assert ca.logprobs == pytest.approx(cb.logprobs, abs=1e-5)
    return True


def _slow_steps(engine: HFEngine, seconds: float) -> None:
    """Make every decoding step of ``engine`` take at least ``seconds`` (to observe things mid-generation)."""
    step = engine._decode_step

    def slow(batch: Any) -> None:
        time.sleep(seconds)
        step(batch)

    engine._decode_step = slow


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=12, n=4, temperature=1.0, seed=3),
        SamplingParams(max_new_tokens=12, n=4, temperature=0.7, top_p=0.9, top_k=8, seed=4),
        SamplingParams(max_new_tokens=12, n=2, temperature=0.0),
    ],
    ids=["t1", "t0.7-p0.9-k8", "greedy"],
)
def test_logprobs_equal_a_full_forward_without_cache(
    engine: HFEngine, reference: Any, full_logprobs: Any, params: SamplingParams
) -> None:
    out = engine.submit(PROMPTS, params).result(30)
    assert [len(group) for group in out] == [params.n] * len(PROMPTS)
    for prompt, group in zip(PROMPTS, out, strict=True):
        for c in group:
            assert 1 <= len(c.token_ids) <= params.max_new_tokens
            assert len(c.logprobs) == len(c.versions) == len(c.token_ids)
            assert c.versions == [0] * len(c.token_ids) and c.behaviour_version == 0
            expected = full_logprobs(reference, prompt, c.token_ids, params.temperature)
            assert c.logprobs == pytest.approx(expected, abs=1e-4)


def test_a_prompt_draws_the_same_completions_alone_or_batched(engine: HFEngine) -> None:
    params = SamplingParams(max_new_tokens=10, n=3, temperature=1.0, top_p=0.95, seed=11)
    batched = engine.submit(PROMPTS, params).result(30)
    for prompt, group in zip(PROMPTS, batched, strict=True):
        assert _same(engine.submit([prompt], params).result(30), [group])
    # the n samples of a prompt are different draws, and an unseeded request draws afresh
    assert len({tuple(c.token_ids) for c in batched[2]}) > 1
    unseeded = SamplingParams(max_new_tokens=10, n=3, temperature=1.0)
    assert engine.submit(PROMPTS, unseeded).result(30) != engine.submit(PROMPTS, unseeded).result(30)


def test_stop_tokens_end_completions_and_max_new_tokens_bounds_them(engine: HFEngine) -> None:
    params = SamplingParams(max_new_tokens=8, n=32, temperature=1.3, stop_token_ids=(5,), seed=5)
    out = engine.submit(PROMPTS, params).result(30)
    reasons = set()
    for group in out:
        for c in group:
            reasons.add(c.finish_reason)
            assert len(c.token_ids) <= 8
            assert not {2, 5} & set(c.token_ids[:-1]), "a stop token ends the completion"
            if c.finish_reason is FinishReason.STOP:
                assert c.token_ids[-1] in (2, 5)  # EOS (from the model's config) or a stop_token_id, kept
            else:
                assert c.finish_reason is FinishReason.LENGTH and len(c.token_ids) == 8
    assert reasons == {FinishReason.STOP, FinishReason.LENGTH}
    # ignore_eos: EOS no longer stops, and without other stop ids every completion runs to its length
    out = engine.submit(PROMPTS, SamplingParams(max_new_tokens=8, n=8, ignore_eos=True, seed=5)).result(30)
    assert all(c.finish_reason is FinishReason.LENGTH and len(c.token_ids) == 8 for g in out for c in g)
    assert any(2 in c.token_ids for g in out for c in g)
    one = engine.submit(PROMPTS, SamplingParams(max_new_tokens=1, n=2, seed=1)).result(30)
    assert all(len(c.token_ids) == 1 for g in one for c in g)


def test_greedy_is_deterministic_and_follows_the_argmax(engine: HFEngine, reference: Any) -> None:
    import torch

    params = SamplingParams(max_new_tokens=10, temperature=0.0, n=3)
    first = engine.submit(PROMPTS, params).result(30)
    assert _same(first, engine.submit(PROMPTS, params).result(30))
    assert all(c.token_ids == group[0].token_ids for group in first for c in group)
    top1 = engine.submit(PROMPTS, SamplingParams(max_new_tokens=10, temperature=0.8, top_k=1, n=1)).result(30)
    assert [g[0].token_ids for g in top1] == [g[0].token_ids for g in first]
    for prompt, group in zip(PROMPTS, first, strict=True):
        seq = list(prompt)
        for _ in range(len(group[0].token_ids)):
            with torch.no_grad():
                seq.append(int(reference(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
        assert group[0].token_ids == seq[len(prompt) :]


def test_requests_join_a_running_batch(engine: HFEngine) -> None:
    """Continuous batching: a short request sent while a long one decodes finishes first, and both draw what
    they would draw alone."""
    long_p = SamplingParams(max_new_tokens=50, ignore_eos=True, n=2, seed=1)
    short_p = SamplingParams(max_new_tokens=3, n=4, seed=2)
    solo_long = engine.submit([[1, 3, 4]], long_p).result(30)
    solo_short = engine.submit([[1, 7, 8, 9, 10]], short_p).result(30)
    _slow_steps(engine, 0.004)
    steps = engine.counters["decode_steps"]
    long_f = engine.submit([[1, 3, 4]], long_p)
    while engine.counters["decode_steps"] < steps + 5:
        time.sleep(0.001)
    short_f = engine.submit([[1, 7, 8, 9, 10]], short_p)
    assert _same(short_f.result(30), solo_short)
    assert not long_f.done()
    deadline = time.monotonic() + 5
    while engine.stats().running_sequences != 2 and time.monotonic() < deadline:  # a snapshot, taken per turn
        time.sleep(0.001)
    assert engine.stats().running_sequences == 2
    assert _same(long_f.result(30), solo_long)


def test_concurrent_async_generate_calls(engine: HFEngine) -> None:
    params = SamplingParams(max_new_tokens=6, n=4, seed=9)
    solo = [engine.submit([p], params).result(30)[0] for p in PROMPTS]

    async def main() -> list[Any]:
        return await asyncio.gather(*(engine.generate([p], params) for p in PROMPTS))

    assert _same([out[0] for out in asyncio.run(main())], solo)


def test_cancelling_a_request_drops_its_sequences_and_the_engine_goes_on(engine: HFEngine) -> None:
    _slow_steps(engine, 0.005)

    async def main() -> None:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(engine.generate(PROMPTS, SamplingParams(max_new_tokens=50, ignore_eos=True)), 0.05)

    asyncio.run(main())
    deadline = time.monotonic() + 5
    while engine.stats().running_sequences and time.monotonic() < deadline:
        time.sleep(0.005)
    assert engine.stats().running_sequences == 0
    assert engine.stats().in_flight_requests == 0
    out = engine.submit([[1, 2]], SamplingParams(max_new_tokens=2)).result(30)
    assert len(out[0][0].token_ids) >= 1


def test_close_aborts_what_is_in_flight_and_refuses_new_work(model_dir: Path) -> None:
    engine = HFEngine.from_pretrained(model_dir)
    _slow_steps(engine, 0.005)
    future = engine.submit(PROMPTS, SamplingParams(max_new_tokens=50, ignore_eos=True, n=2))
    while engine.counters["decode_steps"] < 3:
        time.sleep(0.001)
    engine.close()
    out = future.result(5)
    for group in out:
        for c in group:
            assert c.finish_reason is FinishReason.ABORT and 1 <= len(c.token_ids) < 50
            assert len(c.logprobs) == len(c.versions) == len(c.token_ids)
    with pytest.raises(EngineClosedError):
        engine.submit(PROMPTS, SamplingParams())
    assert engine.stats().state is EngineState.DRAINING
    engine.close()  # idempotent


def test_close_with_drain_finishes_what_is_in_flight(model_dir: Path) -> None:
    engine = HFEngine.from_pretrained(model_dir)
    future = engine.submit(PROMPTS, SamplingParams(max_new_tokens=20, ignore_eos=True))
    engine.close(drain=True)
    assert all(g[0].finish_reason is FinishReason.LENGTH for g in future.result(5))


@pytest.mark.parametrize(
    ("prompts", "params", "match"),
    [
        ([], SamplingParams(), "at least one prompt"),
        ([[1, 2], []], SamplingParams(), "prompt 1 is empty"),
        ([[1, 16]], SamplingParams(), "outside"),
        ([[1, -1]], SamplingParams(), "outside"),
        ([[1] * 60], SamplingParams(max_new_tokens=5), "context of 64"),
        ([[1]], SamplingParams(stop_token_ids=(99,)), "stop_token_ids"),
    ],
)
def test_bad_requests_are_refused_at_once(
    engine: HFEngine, prompts: list[list[int]], params: SamplingParams, match: str
) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        engine.submit(prompts, params)


def test_stats_and_from_pretrained(engine: HFEngine, model_dir: Path) -> None:
    engine.submit(PROMPTS, SamplingParams(max_new_tokens=4, n=2)).result(30)
    deadline = time.monotonic() + 5
    while engine.stats().running_sequences and time.monotonic() < deadline:  # a snapshot, taken per turn
        time.sleep(0.001)
    stats = engine.stats()
    assert (stats.backend, stats.state, stats.policy_version) == ("hf", EngineState.SERVING, 0)
    assert stats.model == str(model_dir)
    assert stats.in_flight_requests == stats.running_sequences == stats.waiting_sequences == 0
    assert stats.counters["sequences"] == 8 and stats.counters["tokens"] >= 8
    assert engine.vocab_size == 16 and engine.eos_token_ids == (2,) and engine.max_context == 64
    assert threading.active_count() >= 2


def test_extra_eos_ids_end_completions_beside_the_checkpoints(model_dir: Path) -> None:
    probe = HFEngine.from_pretrained(model_dir, seed=0)
    try:  # the token the model draws first for this prompt, made an end of sequence
        first = probe.submit([[1, 5, 6]], SamplingParams(max_new_tokens=1, temperature=0)).result(30)[0][0]
    finally:
        probe.close()
    stop = first.token_ids[0]
    with HFEngine.from_pretrained(model_dir, seed=0, extra_eos_token_ids=(stop, 2)) as engine:
        assert engine.eos_token_ids == ((2, stop) if stop != 2 else (2,))
        out = engine.submit([[1, 5, 6]], SamplingParams(max_new_tokens=8, temperature=0)).result(30)[0][0]
    assert out.token_ids == [stop] and out.finish_reason == FinishReason.STOP


def test_the_service_command_names_a_missing_model_path() -> None:
    done = subprocess.run([sys.executable, "-m", "tauflow.rollout"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "model_path" in done.stderr


def test_backends_load_by_name() -> None:
    from tauflow.rollout.engine import engine_class

    assert engine_class("hf") is HFEngine
    with pytest.raises(ValueError, match="unknown engine backend"):
        engine_class("vllm")


def test_a_failing_step_fails_the_requests_in_flight_and_the_engine_goes_on(engine: HFEngine) -> None:
    decode, calls = engine._decode_step, [0]

    def broken_once(batch: Any) -> None:
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("simulated device error")
        decode(batch)

    engine._decode_step = broken_once
    with pytest.raises(RuntimeError, match="simulated device error"):
        engine.submit(PROMPTS, SamplingParams(max_new_tokens=8, ignore_eos=True)).result(30)
    assert "simulated device error" in engine.stats().last_error
    out = engine.submit(PROMPTS, SamplingParams(max_new_tokens=3, ignore_eos=True)).result(30)
    assert all(len(g[0].token_ids) == 3 for g in out)


def test_a_row_whose_logits_are_not_finite_fails_only_its_own_request(engine: HFEngine) -> None:
    # A model that overflows on one request (NaN logits) fails that request; the requests batched with it
    # decode on and every completion comes back.
    import torch

    sample = engine._sample

    def overflowing(batch: Any, logits: Any) -> None:
        poisoned = torch.tensor([row.req.params.seed == 666 for row in batch.rows])
        sample(batch, logits.masked_fill(poisoned[:, None], float("nan")))

    engine._sample = overflowing
    _slow_steps(engine, 0.005)
    params = SamplingParams(max_new_tokens=12, n=4, ignore_eos=True, seed=1)
    victim = engine.submit(PROMPTS, params)
    poisoned = engine.submit(PROMPTS[:2], SamplingParams(max_new_tokens=12, n=3, ignore_eos=True, seed=666))
    with pytest.raises(FloatingPointError, match="not finite"):
        poisoned.result(30)
    out = victim.result(30)
    assert all(len(c.token_ids) == 12 and c.finish_reason is FinishReason.LENGTH for g in out for c in g)
    assert "not finite" in engine.stats().last_error
    engine._sample = sample
    assert engine.submit(PROMPTS[:1], SamplingParams(max_new_tokens=3)).result(30)[0][0].token_ids
    deadline = time.monotonic() + 5
    while engine.stats().running_sequences and time.monotonic() < deadline:  # the failed rows are gone
        time.sleep(0.001)
    assert engine.stats().running_sequences == engine.stats().in_flight_requests == 0


def test_scoring_gives_the_log_probs_generation_reported(engine: HFEngine, reference: Any, full_logprobs: Any) -> None:
    # A teacher's answer for on-policy distillation: the completions the engine sampled, scored again without
    # sampling, carry the log-probs it reported for them (and those of a full forward), at any temperature.
    from tauflow.rollout.engine import ScoredSequence

    params = SamplingParams(max_new_tokens=8, n=2, temperature=0.7, seed=5)
    out = engine.submit(PROMPTS, params).result(30)
    sequences = [ScoredSequence(p, c.token_ids) for p, group in zip(PROMPTS, out, strict=True) for c in group]
    scores = engine.submit_scoring([*sequences, ScoredSequence([1, 2], [])], temperature=0.7).result(30)
    assert scores.policy_version == 0 and scores.logprobs[-1] == []  # an empty completion scores nothing
    completions = [c for group in out for c in group]
    for seq, c, got in zip(sequences, completions, scores.logprobs, strict=False):
        assert got == pytest.approx(c.logprobs, abs=1e-4)
        assert got == pytest.approx(full_logprobs(reference, list(seq.prompt_token_ids), c.token_ids, 0.7), abs=1e-4)
    assert engine.stats().counters["scored_tokens"] == sum(len(c.token_ids) for c in completions)
    # batched in chunks of max_prefill_tokens: the same numbers
    engine._max_prefill_tokens = 12
    again = asyncio.run(engine.score(sequences, 0.7))
    for a, b in zip(again.logprobs, scores.logprobs, strict=False):
        assert a == pytest.approx(b, abs=1e-5)


@pytest.mark.parametrize(
    ("sequences", "temperature", "match"),
    [
        ([], 1.0, "at least one sequence"),
        ([([], [3])], 1.0, r"sequences\[0\].prompt_token_ids is empty"),
        ([([1], [3]), ([1], [16])], 1.0, r"sequences\[1\] has a token id outside"),
        ([([1] * 60, [3] * 5)], 1.0, "context of 64"),
        ([([1], [3])], 0.0, "temperature"),
        ([([1], [3])], float("nan"), "temperature"),
        ([([1], [3])], 1e-40, "temperature must be a finite number of at least 1e-05"),  # NaN log-probs once
    ],
)
def test_bad_scoring_requests_are_refused_at_once(
    engine: HFEngine, sequences: list[tuple[list[int], list[int]]], temperature: float, match: str
) -> None:
    from tauflow.rollout.engine import ScoredSequence

    with pytest.raises(InvalidRequestError, match=match):
        engine.submit_scoring([ScoredSequence(p, c) for p, c in sequences], temperature)


def test_close_fails_the_scoring_not_yet_done(model_dir: Path) -> None:
    from tauflow.rollout.engine import ScoredSequence

    engine = HFEngine.from_pretrained(model_dir)
    engine.close()
    with pytest.raises(EngineClosedError):
        engine.submit_scoring([ScoredSequence([1], [3])])


def test_a_scoring_call_given_up_or_failing_leaves_generation_alone(engine: HFEngine) -> None:
    # A caller that gave up before its job ran (a deadline) costs nothing; a job that fails fails alone: the
    # running batch decodes on and every completion comes back.
    from tauflow.rollout.engine import ScoredSequence

    _slow_steps(engine, 0.02)
    running = engine.submit(PROMPTS, SamplingParams(max_new_tokens=12, n=2, temperature=1.0, seed=2))
    given_up = engine.submit_scoring([ScoredSequence([1, 2], [3, 4])])
    given_up.cancel()
    score = engine._score_chunk

    def broken(job: Any) -> Any:
        raise RuntimeError("device fell over")

    engine._score_chunk = broken  # type: ignore[method-assign]
    failing = engine.submit_scoring([ScoredSequence([1, 2], [3, 4])])
    with pytest.raises(RuntimeError, match="fell over"):
        failing.result(30)
    engine._score_chunk = score  # type: ignore[method-assign]
    out = running.result(60)
    assert all(len(c.token_ids) >= 1 for group in out for c in group)
    assert given_up.cancelled()
    assert engine.submit_scoring([ScoredSequence([1, 2], [3, 4])]).result(30).logprobs[0]  # and it serves on


def _long_scoring(rows: int = 24) -> list[Any]:
    """Sequences of 40 tokens each: with max_prefill_tokens 40, one sequence a chunk (``rows`` chunks)."""
    from tauflow.rollout.engine import ScoredSequence

    return [ScoredSequence([1, 3 + i % 10] * 10, [4 + (i * 7 + j) % 10 for j in range(20)]) for i in range(rows)]


def test_scoring_goes_one_chunk_a_turn_and_generation_decodes_between_its_chunks(model_dir: Path) -> None:
    # A long ComputeLogprobs job (here 24 chunks) used to run whole on one turn of the engine: every decoding
    # step of every Generate waited for it, and for every job queued before it. Now a turn scores one chunk:
    # a short Generate sent with two such jobs ends before the first of them.
    engine = HFEngine.from_pretrained(model_dir, seed=1, max_prefill_tokens=40)
    try:
        _slow_steps(engine, 0.02)
        scoring: list[Any] = []
        seen: list[bool] = []  # at each decoding step: was the first scoring job done?
        step = engine._decode_step

        def watched(batch: Any) -> None:
            step(batch)
            seen.append(bool(scoring) and scoring[0].done())

        engine._decode_step = watched  # type: ignore[method-assign]
        generated = engine.submit([[1, 5, 6]], SamplingParams(max_new_tokens=6, ignore_eos=True, seed=1))
        scoring.extend(engine.submit_scoring(_long_scoring()) for _ in range(2))
        assert len(generated.result(30)[0][0].token_ids) == 6
        assert seen and not any(seen)
        for f in scoring:
            assert len(f.result(60).logprobs) == 24
    finally:
        engine.close()


def test_chunked_scoring_gives_what_scoring_whole_gives(
    model_dir: Path, reference: Any, make_model: Any, full_logprobs: Any
) -> None:
    # The same sequences scored in one chunk, and in 24 chunks interleaved with generation and with a weight
    # version staged mid-job: the same numbers, of the version served when the job started (the staged one
    # waits for its last chunk, then serves the next job).
    from tauflow.rollout.engine import ScoredSequence

    sequences = _long_scoring()
    quiet = HFEngine.from_pretrained(model_dir, seed=1, max_prefill_tokens=40)
    whole_engine = HFEngine.from_pretrained(model_dir, seed=1, max_prefill_tokens=1 << 15)
    chunked = HFEngine.from_pretrained(model_dir, seed=1, max_prefill_tokens=40)
    try:
        whole = whole_engine.submit_scoring(sequences, 0.8).result(60)
        alone = quiet.submit_scoring(sequences, 0.8).result(60)
        score, staged, new_weights = chunked._score_chunk, [], make_model(seed=1).state_dict()

        def staging_mid_job(job: Any) -> bool:
            if job.order is not None and len(job.order) == 12:
                staged.append(chunked.stage_weights(1, new_weights))
            return score(job)

        chunked._score_chunk = staging_mid_job  # type: ignore[method-assign]
        generating = chunked.submit([[1, 5, 6]], SamplingParams(max_new_tokens=30, ignore_eos=True, seed=2))
        got = chunked.submit_scoring(sequences, 0.8).result(60)
        assert staged and got.policy_version == whole.policy_version == 0
        assert got.logprobs == alone.logprobs  # exactly: the same chunks, whatever ran between them
        for seq, a, b in zip(sequences, got.logprobs, whole.logprobs, strict=True):
            assert a == pytest.approx(b, abs=1e-5)  # (one batch of 24 rows against 24 of one: float noise)
            expected = full_logprobs(reference, list(seq.prompt_token_ids), list(seq.completion_token_ids), 0.8)
            assert a == pytest.approx(expected, abs=1e-4)
        assert staged[0].result(10) == 1
        after = chunked.submit_scoring([ScoredSequence([1, 2], [3, 4])], 0.8).result(30)
        assert after.policy_version == 1
        assert generating.result(30)[0][0].token_ids
    finally:
        for e in (quiet, whole_engine, chunked):
            e.close()


def test_a_scoring_job_whose_caller_went_away_stops_at_its_next_chunk(model_dir: Path) -> None:
    from tauflow.rollout.engine import ScoredSequence

    engine = HFEngine.from_pretrained(model_dir, seed=1, max_prefill_tokens=40)
    try:
        score, chunks, cancelled = engine._score_chunk, [0], threading.Event()

        def counted(job: Any) -> bool:
            chunks[0] += 1
            if chunks[0] == 3:
                assert job.future.cancel()  # the caller's deadline, mid-job
                cancelled.set()
            return score(job)

        engine._score_chunk = counted  # type: ignore[method-assign]
        given_up = engine.submit_scoring(_long_scoring())
        assert cancelled.wait(30)
        assert engine.submit_scoring([ScoredSequence([1, 2], [3, 4])]).result(30).logprobs[0]
        assert given_up.cancelled() and chunks[0] == 4  # its 3 chunks, then the next job's one
    finally:
        engine.close()


def test_a_weight_version_whose_caller_left_is_still_loaded_and_generation_goes_on(
    model_dir: Path, make_model: Any
) -> None:
    """The weight sidecar died (its Load call cancelled, and with it the engine's future) after the engine had
    taken the staged versions: setting the cancelled future's result raised in the engine's thread, whose
    catch-all failed every request in flight, and a newer version copied in with it was never published (the
    engine served version 2's weights as version 1)."""
    from tauflow.rollout.engine.base import settle

    engine = HFEngine.from_pretrained(model_dir, seed=1)
    apply = engine._apply_weights

    def caller_gone(staged: list[Any]) -> None:
        for s in staged:
            if s.version == 1:
                s.future.cancel()
        apply(staged)

    engine._apply_weights = caller_gone  # type: ignore[method-assign]
    _slow_steps(engine, 0.02)
    try:
        generating = engine.submit([[1, 5, 6]], SamplingParams(max_new_tokens=40, ignore_eos=True, seed=2))
        while engine.stats().running_sequences == 0:
            time.sleep(0.005)
        weights = make_model(seed=1).state_dict()
        with engine._cv:  # both staged before the next safe point: one swap takes both
            first, second = engine.stage_weights(1, weights), engine.stage_weights(2, weights)
        assert second.result(30) == 2 and first.cancelled()
        assert engine.policy_version == 2  # (published, though the first's caller was gone)
        completion = generating.result(60)[0][0]
        assert len(completion.token_ids) == 40 and 2 in completion.versions  # generated on, through the swap
    finally:
        engine.close()
    # settle: a caller's future resolved unless it was cancelled, whichever thread cancels it
    from concurrent.futures import Future

    cancelled, pending = Future(), Future()
    assert cancelled.cancel() and not settle(cancelled, 1) and cancelled.cancelled()
    assert settle(pending, error=ValueError("x")) and isinstance(pending.exception(), ValueError)
    assert not settle(pending, 2)  # (done already: left as it is)
