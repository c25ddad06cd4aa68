"""Weight swaps in the hf engine: staged versions load at a safe point between decoding steps, in-flight requests
go on with the new weights (their later tokens carry the new version and are drawn from exactly the new weights),
and a bad version is rejected while the old weights keep serving."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tauflow.rollout.engine import FinishReason, SamplingParams, WeightUpdateError
from tauflow.rollout.engine.hf import HFEngine

from .conftest import TINY

PROMPTS = [[1, 5, 6, 7], [1, 3], [1, 9, 10, 11, 12, 13, 14]]


def _stage_during_step(engine: HFEngine, step: int, version: int, tensors: dict[str, torch.Tensor]) -> list[Any]:
    """Stage ``tensors`` from inside the engine's ``step``-th decoding step (counted from now): a deterministic
    mid-generation swap. Returns a list that receives the staging future."""
    decode, calls, futures = engine._decode_step, [0], []

    def hooked(batch: Any) -> None:
        calls[0] += 1
        if calls[0] == step:
            futures.append(engine.stage_weights(version, tensors))
        decode(batch)

    engine._decode_step = hooked
    return futures


def test_a_swap_mid_generation_keeps_requests_and_switches_versions_per_token(
    engine: HFEngine, reference: Any, make_model: Any, full_logprobs: Any
) -> None:
    new_model = make_model(seed=1)
    loaded: list[int] = []
    engine.add_version_listener(loaded.append)
    params = SamplingParams(max_new_tokens=12, n=3, temperature=0.9, ignore_eos=True, seed=7)
    futures = _stage_during_step(engine, 3, 1, new_model.state_dict())
    out = engine.submit(PROMPTS, params).result(30)
    assert futures[0].result(5) == 1 and engine.policy_version == 1 and loaded == [1]
    assert engine.wait_for_version(1, timeout=0)
    for prompt, group in zip(PROMPTS, out, strict=True):
        for c in group:
            assert c.finish_reason is FinishReason.LENGTH and len(c.token_ids) == 12  # nothing aborted
            # token 0 comes from the prefill, tokens 1..3 from decoding steps 1..3; the swap follows step 3
            assert c.versions == [0] * 4 + [1] * 8
            assert c.behaviour_version == 0
            old = full_logprobs(reference, prompt, c.token_ids, 0.9)
            new = full_logprobs(new_model, prompt, c.token_ids, 0.9)
            assert c.logprobs[:4] == pytest.approx(old[:4], abs=1e-4)
            assert c.logprobs[4:] == pytest.approx(new[4:], abs=1e-4)  # KV recomputed with the new weights
            assert c.logprobs[4:] != pytest.approx(old[4:], abs=1e-3)
    # the next request is served by version 1 only
    after = engine.submit(PROMPTS[:1], params).result(30)[0][0]
    assert after.versions == [1] * 12
    assert after.logprobs == pytest.approx(full_logprobs(new_model, PROMPTS[0], after.token_ids, 0.9), abs=1e-4)


def test_versions_staged_from_another_thread_while_decoding(
    engine: HFEngine, reference: Any, make_model: Any, full_logprobs: Any
) -> None:
    models = {0: reference, 1: make_model(seed=1), 2: make_model(seed=2)}
    decode = engine._decode_step

    def slow(batch: Any) -> None:
        time.sleep(0.004)
        decode(batch)

    engine._decode_step = slow
    params = SamplingParams(max_new_tokens=50, n=2, ignore_eos=True, seed=3)
    future = engine.submit(PROMPTS, params)
    while engine.counters["decode_steps"] < 5:
        time.sleep(0.001)
    assert engine.stage_weights(1, models[1].state_dict()).result(5) == 1
    while engine.counters["decode_steps"] < 15:
        time.sleep(0.001)
    assert engine.stage_weights(2, models[2].state_dict()).result(5) == 2
    out = future.result(30)
    for prompt, group in zip(PROMPTS, out, strict=True):
        for c in group:
            assert len(c.token_ids) == 50 and c.versions == sorted(c.versions) and set(c.versions) == {0, 1, 2}
            for v, model in models.items():
                idx = [i for i, tv in enumerate(c.versions) if tv == v]
                expected = full_logprobs(model, prompt, c.token_ids, 1.0)
                assert [c.logprobs[i] for i in idx] == pytest.approx([expected[i] for i in idx], abs=1e-4)


def test_without_kv_recomputation_later_tokens_still_carry_the_new_version(model_dir: Path, make_model: Any) -> None:
    engine = HFEngine.from_pretrained(model_dir, recompute_kv_on_swap=False)
    try:
        _stage_during_step(engine, 2, 1, make_model(seed=1).state_dict())
        out = engine.submit(PROMPTS, SamplingParams(max_new_tokens=6, ignore_eos=True, seed=1)).result(30)
        assert all(g[0].versions == [0, 0, 0, 1, 1, 1] for g in out)
        assert engine.counters["kv_recomputed_tokens"] == 0
    finally:
        engine.close()


def test_swaps_while_idle_and_several_versions_in_a_row(engine: HFEngine, make_model: Any) -> None:
    seen: list[int] = []
    engine.add_version_listener(seen.append)
    first = engine.stage_weights(1, make_model(seed=1).state_dict())
    second = engine.stage_weights(2, make_model(seed=2).state_dict())
    assert (first.result(5), second.result(5)) == (1, 2)
    assert seen == [1, 2] and engine.policy_version == 2
    assert not engine.stats().weight_update_in_progress


def test_a_broadcast_at_or_below_a_staged_version_rebases_and_drops_it(engine: HFEngine, make_model: Any) -> None:
    """Version 0 serves, version 2 is staged but not swapped in yet, and the sidecar sends version 1 (the trainer
    resumed from its checkpoint of version 1): 1 must replace 2, not be refused as "not newer than 2"."""
    inside, gate = threading.Event(), threading.Event()
    decode = engine._decode_step

    def held(batch: Any) -> None:  # the engine thread waits inside a decoding step: nothing staged swaps in
        inside.set()
        gate.wait(30)
        decode(batch)

    engine._decode_step = held
    request = engine.submit(PROMPTS[:1], SamplingParams(max_new_tokens=6, ignore_eos=True, seed=1))
    assert inside.wait(30)
    staged = engine.stage_weights(2, make_model(seed=2).state_dict())
    assert (engine.policy_version, engine.newest_version) == (0, 2)
    rebased = engine.stage_broadcast(1, make_model(seed=1).state_dict())
    engine._decode_step = decode
    gate.set()
    assert rebased.result(10) == 1
    assert staged.cancelled()  # dropped: version 2 never serves
    tokens = request.result(30)[0][0]
    assert max(tokens.versions) == 1 and engine.policy_version == 1 == engine.newest_version
    # the next version from the sidecar is an ordinary one again
    assert engine.stage_broadcast(2, make_model(seed=2).state_dict()).result(10) == 2


def test_a_partial_update_replaces_only_the_named_tensors(
    engine: HFEngine, reference: Any, make_model: Any, full_logprobs: Any
) -> None:
    other = make_model(seed=5)
    engine.stage_weights(1, {"lm_head.weight": other.lm_head.weight}).result(5)
    expected = make_model(seed=0)  # the checkpoint's weights ...
    expected.load_state_dict({**reference.state_dict(), "lm_head.weight": other.lm_head.weight})  # ... new head
    c = engine.submit(PROMPTS[:1], SamplingParams(max_new_tokens=8, seed=2)).result(30)[0][0]
    assert c.logprobs == pytest.approx(full_logprobs(expected, PROMPTS[0], c.token_ids, 1.0), abs=1e-4)


def _bad_versions(reference: Any) -> list[tuple[int, dict[str, Any], str]]:
    good = reference.state_dict()
    name = "model.layers.0.mlp.up_proj.weight"
    return [
        (1, {**good, name: good[name].t().contiguous()}, "shape"),
        (1, {**good, "model.layers.7.mlp.up_proj.weight": good[name]}, "unknown weight name"),
        (1, {name: torch.full_like(good[name], float("nan"))}, "non-finite"),
        (1, {name: good[name].to(torch.int64)}, "dtype"),
        (1, {name: good[name].tolist()}, "must be tensors"),
        (1, {}, "at least one tensor"),
        (0, good, "not newer"),
    ]


def test_bad_versions_are_rejected_and_the_old_weights_keep_serving(
    engine: HFEngine, reference: Any, full_logprobs: Any
) -> None:
    for version, tensors, match in _bad_versions(reference):
        with pytest.raises(WeightUpdateError, match=match):
            engine.stage_weights(version, tensors)
    assert engine.policy_version == 0
    assert not engine.stats().weight_update_in_progress
    c = engine.submit(PROMPTS[:1], SamplingParams(max_new_tokens=8, seed=2)).result(30)[0][0]
    assert c.versions == [0] * len(c.token_ids)
    assert c.logprobs == pytest.approx(full_logprobs(reference, PROMPTS[0], c.token_ids, 1.0), abs=1e-4)
    # a good version still loads afterwards, and the same version cannot be staged twice
    engine.stage_weights(1, reference.state_dict()).result(5)
    with pytest.raises(WeightUpdateError, match="not newer"):
        engine.stage_weights(1, reference.state_dict())


def test_weight_spec_names_every_parameter(engine: HFEngine, reference: Any) -> None:
    spec = engine.weight_spec()
    assert set(spec) == set(reference.state_dict())
    assert all(spec[n].shape == tuple(t.shape) and spec[n].dtype == t.dtype for n, t in reference.state_dict().items())


def test_tied_embeddings_answer_to_both_names(tmp_path: Path) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**TINY, tie_word_embeddings=True)
    Qwen2ForCausalLM(config).save_pretrained(tmp_path)
    engine = HFEngine.from_pretrained(tmp_path)
    try:
        spec = engine.weight_spec()
        assert {"lm_head.weight", "model.embed_tokens.weight"} <= set(spec)
        head = torch.randn(16, 32)
        engine.stage_weights(1, {"lm_head.weight": head}).result(5)
        assert torch.equal(engine._model.get_input_embeddings().weight, head)  # one tensor under two names
    finally:
        engine.close()


def _wait_for_offloads(engine: HFEngine, count: int) -> None:
    deadline = time.monotonic() + 30
    while engine.counters["weight_offloads"] < count and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.counters["weight_offloads"] == count


def test_an_engine_offloading_its_weights_when_idle_serves_each_version_exactly(
    model_dir: Path, reference: Any, make_model: Any, full_logprobs: Any
) -> None:
    """Colocated mode: the weights leave the device whenever the engine runs out of work after serving (not
    after a weight update alone), come back for the next forward, and a version staged meanwhile becomes the
    weights as it is. Every completion's log-probs are those of the version it names."""
    from tauflow.rollout.engine import ScoredSequence

    engine = HFEngine.from_pretrained(model_dir, seed=3, offload_weights_when_idle=True)
    params = list(engine._model.parameters())
    try:
        time.sleep(0.1)
        assert engine.counters["weight_offloads"] == 0 and all(p.numel() > 0 for p in params)  # never served yet
        c = engine.submit(PROMPTS[:1], SamplingParams(max_new_tokens=6, seed=2)).result(30)[0][0]
        assert c.logprobs == pytest.approx(full_logprobs(reference, PROMPTS[0], c.token_ids, 1.0), abs=1e-4)
        _wait_for_offloads(engine, 1)
        assert all(p.numel() == 0 for p in params) and engine.memory_releases == 1

        v1 = make_model(seed=1)
        assert engine.stage_weights(1, v1.state_dict()).result(10) == 1
        time.sleep(0.2)  # idle again, after a weight update alone: the weights stay for the requests to come
        assert engine.counters["weight_offloads"] == 1 and all(p.numel() > 0 for p in params)
        c = engine.submit(PROMPTS[1:2], SamplingParams(max_new_tokens=6, seed=4)).result(30)[0][0]
        assert set(c.versions) == {1}
        assert c.logprobs == pytest.approx(full_logprobs(v1, PROMPTS[1], c.token_ids, 1.0), abs=1e-4)
        _wait_for_offloads(engine, 2)

        # offloaded: a partial update takes its tensors as they are, the rest come back from host memory
        head = make_model(seed=5).lm_head.weight.detach().clone()
        assert engine.stage_weights(2, {"lm_head.weight": head}).result(10) == 2
        expected = make_model(seed=1)
        expected.load_state_dict({**v1.state_dict(), "lm_head.weight": head})
        scores = engine.submit_scoring([ScoredSequence(PROMPTS[2], c.token_ids)]).result(30)
        assert scores.policy_version == 2
        assert scores.logprobs[0] == pytest.approx(full_logprobs(expected, PROMPTS[2], c.token_ids, 1.0), abs=1e-4)
        _wait_for_offloads(engine, 3)  # scoring is serving too
        assert engine.stats().counters["weight_offloads"] == 3
    finally:
        engine.close()


def test_an_engine_between_two_close_calls_keeps_its_weights_and_closes_while_resting(model_dir: Path) -> None:
    # release_after_idle_s: a gap shorter than it costs no round trip of the weights; close ends the wait
    engine = HFEngine.from_pretrained(model_dir, seed=3, offload_weights_when_idle=True, release_after_idle_s=60)
    for seed in range(3):
        engine.submit(PROMPTS[:1], SamplingParams(max_new_tokens=4, seed=seed)).result(30)
    assert engine.counters["weight_offloads"] == 0 and engine.memory_releases == 0
    started = time.monotonic()
    engine.close(timeout=10)
    assert not engine._thread.is_alive() and time.monotonic() - started < 10
    with pytest.raises(ValueError, match="release_after_idle_s"):
        HFEngine.from_pretrained(model_dir, release_after_idle_s=-1)


def test_a_failed_group_build_is_said_in_the_rollouts_own_log(caplog: pytest.LogCaptureFixture) -> None:
    # under a store attack the rollout's log said only "joining again", never why
    import asyncio
    import socket

    from tauflow.rollout.weights import WeightLoader
    from tauflow.weightsync import GroupSpec, PhaseError

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        unserved = int(s.getsockname()[1])
    loader = WeightLoader(object(), "rollout-0", None)  # type: ignore[arg-type]  # (a build needs no engine)

    async def build() -> None:
        with pytest.raises(PhaseError):
            await loader.init_group(GroupSpec("127.0.0.1", unserved, "gone-e1", 2, 1, "gloo", 1, 1.0))
        await asyncio.sleep(0)  # (the done-callback runs)

    with caplog.at_level("WARNING", logger="tauflow.rollout.weights"):
        asyncio.run(build())
    assert any("weight group build failed" in r.getMessage() and r.group == "gone-e1" for r in caplog.records)
    loader.close()
    for thread in threading.enumerate():  # (one still in torch's connect when the process exits aborts it)
        if thread.name.startswith("store-connect-"):
            thread.join(5)


def test_the_loaders_threads_start_with_it_and_a_group_build_starts_none() -> None:
    # a thread started at the first build or load, when memory was short for a moment, failed to start and
    # left that call waiting for good (as the trainer's checkpoint did): the loader starts its threads when made
    import asyncio
    import socket

    from tauflow.rollout.weights import WeightLoader
    from tauflow.weightsync import GroupSpec, PhaseError

    before = {t.ident for t in threading.enumerate()}
    loader = WeightLoader(object(), "rollout-0", None)  # type: ignore[arg-type]
    made = [t for t in threading.enumerate() if t.ident not in before and t.name.startswith("weights")]
    assert sorted(t.name.rsplit("_", 1)[0] for t in made) == ["weights", "weights-group", "weights-shared"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        unserved = int(s.getsockname()[1])

    async def build() -> set[str]:
        loop_threads = {t.ident for t in threading.enumerate()}
        with pytest.raises(PhaseError):
            await loader.init_group(GroupSpec("127.0.0.1", unserved, "gone-e2", 2, 1, "gloo", 1, 1.0))
        # (but the store's connect thread, whose caller waits for it within the timeout, whatever befalls it)
        new = {t.name for t in threading.enumerate() if t.ident not in loop_threads}
        return {name for name in new if not name.startswith("store-connect-")}

    assert asyncio.run(build()) == set()
    loader.close()
    for thread in made:
        thread.join(5)
    assert not any(t.is_alive() for t in made)
    for thread in threading.enumerate():  # (one still in torch's connect when the process exits aborts it)
        if thread.name.startswith("store-connect-"):
            thread.join(5)
