"""The RolloutService layer, called directly with a stand-in for gRPC's context: what a hostile client's
requests get (the documented code, never INTERNAL) and that they change nothing and block no other client."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration

from tauflow.api.rollout.v1 import rollout_pb2 as pb
from tauflow.rollout.adapters.servicer import LONG_TEXT_CHARS, RolloutServicer
from tauflow.rollout.config import RolloutConfig
from tauflow.rollout.engine.base import MAX_POLICY_VERSION
from tauflow.rollout.engine.hf import HFEngine
from tauflow.rollout.ports import SidecarUnavailable, UnknownVersion
from tauflow.rollout.text import TextCodec
from tauflow.rollout.weights import CHECKSUM_ALGORITHMS_KEPT, WeightLoader
from tauflow.weightsync import GroupSpec, StoreHost, WeightGroup, shared_request
from tauflow.weightsync.ipc import DeviceStager
from tauflow.weightsync.wire import shared_request_to_proto


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class Context:
    """What the servicer uses of ``grpc.aio.ServicerContext``."""

    def __init__(self, time_remaining: float | None = None) -> None:
        self._deadline = None if time_remaining is None else time.monotonic() + time_remaining

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


class Codec:
    """A tokenizer stand-in: a character a token (``max_chars_per_token``: None, no bound known, or 1)."""

    has_chat_template = False

    def __init__(self, max_chars_per_token: int | None = None) -> None:
        self.max_chars_per_token = max_chars_per_token
        self.encoded: list[str] = []

    def check_length(self, text: str, max_tokens: int | None, what: str = "prompt_text") -> None:
        TextCodec.check_length(self, text, max_tokens, what)  # type: ignore[arg-type]

    def min_tokens(self, text: str) -> int:
        return TextCodec.min_tokens(self, text)  # type: ignore[arg-type]

    def encode(self, text: str) -> list[int]:
        self.encoded.append(text)
        return [1] + [3 + ord(c) % 10 for c in text]

    def decode(self, ids: list[int]) -> str:
        return ""


class Sidecar:
    """The weight sidecar's port: knows the checksum algorithm of ``known`` versions only."""

    def __init__(self, known: tuple[int, ...] = (), up: bool = True) -> None:
        self.known = known
        self.up = up
        self.asked: list[int] = []

    async def checksum_algorithm(self, policy_version: int) -> str:
        self.asked.append(policy_version)
        if not self.up:
            raise SidecarUnavailable("GetManifest: UNAVAILABLE")
        if policy_version not in self.known:
            raise UnknownVersion(f"the weight sidecar holds no manifest of version {policy_version}")
        return "xxh3_128"

    async def confirm(self, *args: Any) -> None:
        pass


def _servicer(
    engine: HFEngine, model_dir: Path, sidecar: Sidecar | None = None, codec: Codec | None = None, **config: Any
) -> RolloutServicer:
    weights = WeightLoader(engine, "rollout-0", sidecar)  # type: ignore[arg-type]
    config = RolloutConfig(model_path=str(model_dir), **config)
    servicer = RolloutServicer(config, engine, weights, None, codec or Codec())  # type: ignore[arg-type]
    _made.append(servicer)
    return servicer


_made: list[RolloutServicer] = []  # closed after each test: their threads are started when they are made


@pytest.fixture(autouse=True)
def _close_servicers() -> Iterator[None]:
    yield
    while _made:
        servicer = _made.pop()
        servicer.close()
        servicer.weights.close()


async def _refused(call: Any) -> Aborted:
    with pytest.raises(Aborted) as refused:
        await call
    return refused.value


# -- temperature -------------------------------------------------------------------------------------------


def test_a_tiny_temperature_is_refused_naming_the_field(engine: HFEngine, model_dir: Path) -> None:
    servicer = _servicer(engine, model_dir)

    async def main() -> None:
        for tiny in (1e-40, 1e-30, 1e-6):
            generate = pb.GenerateRequest(
                prompt_token_ids=[1, 5], sampling=pb.SamplingParams(max_new_tokens=2, temperature=tiny)
            )
            refused = await _refused(servicer.Generate(generate, Context()))
            assert refused.code == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in refused.details
            score = pb.ComputeLogprobsRequest(
                sequences=[pb.ScoredSequence(prompt_token_ids=[1, 5], completion_token_ids=[3])], temperature=tiny
            )
            refused = await _refused(servicer.ComputeLogprobs(score, Context()))
            assert refused.code == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in refused.details
        assert servicer.in_flight == 0 and engine.stats().last_error == ""
        ok = pb.GenerateRequest(prompt_token_ids=[1, 5], sampling=pb.SamplingParams(max_new_tokens=2, temperature=1e-5))
        assert len((await servicer.Generate(ok, Context())).samples[0].completion_token_ids) == 2

    asyncio.run(main())


# -- min_policy_version ------------------------------------------------------------------------------------


def test_a_min_policy_version_wait_holds_no_thread_and_ends_with_its_caller(
    engine: HFEngine, model_dir: Path, reference: Any
) -> None:
    servicer = _servicer(engine, model_dir, max_wait_s=8)  # (a wait that held a thread would end in 8 s)
    waiting = pb.GenerateRequest(  # (a version the engine never reaches here, within max_version_lead)
        prompt_token_ids=[1, 5], min_policy_version=64, sampling=pb.SamplingParams(max_new_tokens=2)
    )
    text = pb.GenerateRequest(prompt_text="12+34=", sampling=pb.SamplingParams(max_new_tokens=2))

    async def main() -> None:
        # One thread in the loop's default pool, where prompt_text is tokenized: the waits must not hold it.
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(1))
        waits = [asyncio.create_task(servicer.Generate(waiting, Context())) for _ in range(3)]
        await asyncio.sleep(0.2)
        answer = await asyncio.wait_for(servicer.Generate(text, Context()), 5)  # another client's, meanwhile
        assert len(answer.samples) == 1 and answer.prompt_token_ids == Codec().encode("12+34=")
        for w in waits:  # the waiting clients go away
            w.cancel()
        await asyncio.gather(*waits, return_exceptions=True)
        assert servicer.in_flight == servicer.version_waiters == 0 and not engine._version_listeners
        await asyncio.wait_for(asyncio.to_thread(lambda: None), 5)

        # A wait ends with the version it waits for, or with its deadline.
        soon = pb.GenerateRequest(
            prompt_token_ids=[1, 5], min_policy_version=1, sampling=pb.SamplingParams(max_new_tokens=2)
        )
        refused = await _refused(servicer.Generate(soon, Context(time_remaining=0.2)))
        assert refused.code == grpc.StatusCode.DEADLINE_EXCEEDED and servicer.version_waiters == 0
        served = asyncio.create_task(servicer.Generate(soon, Context()))
        await asyncio.sleep(0.05)
        assert not served.done()
        await asyncio.wrap_future(engine.stage_weights(1, reference.state_dict()))
        answer = await asyncio.wait_for(served, 10)
        assert set(answer.samples[0].token_versions) == {1}
        assert not engine._version_listeners

    asyncio.run(main())


def _small(min_policy_version: int = 0) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt_token_ids=[1, 5], min_policy_version=min_policy_version, sampling=pb.SamplingParams(max_new_tokens=1)
    )


_SCORE = pb.ComputeLogprobsRequest(sequences=[pb.ScoredSequence(prompt_token_ids=[1, 5], completion_token_ids=[3])])


def test_a_min_policy_version_far_ahead_of_the_engines_is_refused_at_once_naming_the_field(
    engine: HFEngine, model_dir: Path
) -> None:
    # 64 calls with min_policy_version 10**9 (below 2**53) held every slot of max_in_flight for max_wait_s
    # (600 s): every other Generate and ComputeLogprobs got RESOURCE_EXHAUSTED. Refused at once now: UNAVAILABLE
    # (the server has not loaded that version; the documented code), and the refusal holds and changes nothing.
    servicer = _servicer(engine, model_dir)
    assert servicer.config.max_version_lead == 64

    async def main() -> None:
        for version in (10**9, MAX_POLICY_VERSION, 2**64 - 1, 65):
            for _ in range(3):
                refused = await _refused(asyncio.wait_for(servicer.Generate(_small(version), Context()), 2))
                assert refused.code == grpc.StatusCode.UNAVAILABLE
                assert f"min_policy_version {version}" in refused.details and "max_version_lead" in refused.details
        assert servicer.in_flight == servicer.version_waiters == 0 and not engine._version_listeners
        assert engine.policy_version == 0 and engine.stats().last_error == ""
        # within the lead: it waits (for the version, within max_wait_s and its deadline)
        waiting = asyncio.create_task(servicer.Generate(_small(64), Context()))
        await asyncio.sleep(0.1)
        assert not waiting.done() and servicer.version_waiters == 1
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        assert servicer.version_waiters == 0 and not engine._version_listeners

    asyncio.run(main())

    no_waits = _servicer(engine, model_dir, max_version_lead=0)  # a server that never waits for a version
    refused = asyncio.run(_refused(no_waits.Generate(_small(1), Context())))
    assert refused.code == grpc.StatusCode.UNAVAILABLE and "min_policy_version 1 " in refused.details
    assert len(asyncio.run(no_waits.Generate(_small(0), Context())).samples) == 1


def test_calls_waiting_for_a_version_hold_no_slot_of_max_in_flight_and_another_client_is_served(
    engine: HFEngine, model_dir: Path
) -> None:
    # The probe's 64 waiters, at the largest version within max_version_lead: max_version_waiters (32) of them
    # wait, the rest are refused (RESOURCE_EXHAUSTED naming the bound); no slot of max_in_flight is held, so
    # another client's 10 Generates and a ComputeLogprobs are served meanwhile.
    servicer = _servicer(engine, model_dir)
    assert (servicer.config.max_in_flight, servicer.config.max_version_waiters) == (64, 32)

    async def main() -> None:
        calls = [asyncio.create_task(servicer.Generate(_small(64), Context())) for _ in range(64)]
        await asyncio.sleep(0.2)
        refused = [c.exception() for c in calls if c.done()]
        assert len(refused) == 32 and servicer.version_waiters == 32 and servicer.in_flight == 0
        for e in refused:
            assert isinstance(e, Aborted) and e.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_version_waiters" in e.details
        for _ in range(10):
            answer = await asyncio.wait_for(servicer.Generate(_small(), Context()), 10)
            assert len(answer.samples[0].completion_token_ids) == 1
        scored = await asyncio.wait_for(servicer.ComputeLogprobs(_SCORE, Context()), 10)
        assert len(scored.sequences[0].logprobs) == 1
        status = await servicer.GetStatus(pb.GetStatusRequest(), Context())
        assert status.in_flight_requests == 32  # the waiting calls are admitted and not yet answered
        for c in calls:
            c.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        assert servicer.in_flight == servicer.version_waiters == 0 and not engine._version_listeners

    asyncio.run(main())


def test_waiters_for_the_next_version_are_served_when_it_comes_even_over_max_in_flight(
    engine: HFEngine, model_dir: Path, reference: Any
) -> None:
    # A producer's ticket one version ahead of the engine (the trainer publishes one every step): its calls
    # wait for the weight update, and are all served once it is loaded, though they outnumber max_in_flight
    # (a waiter takes its slot then; max_in_flight + max_version_waiters calls run at most).
    servicer = _servicer(engine, model_dir, max_in_flight=2, max_version_waiters=4)

    async def main() -> None:
        waiting = [asyncio.create_task(servicer.Generate(_small(1), Context())) for _ in range(4)]
        await asyncio.sleep(0.1)
        assert not any(w.done() for w in waiting) and servicer.version_waiters == 4
        fifth = await _refused(servicer.Generate(_small(1), Context()))
        assert fifth.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_version_waiters" in fifth.details
        # calls that can run now: admitted up to max_in_flight, as before
        assert len((await asyncio.wait_for(servicer.Generate(_small(0), Context()), 10)).samples) == 1
        await asyncio.wrap_future(engine.stage_weights(1, reference.state_dict()))
        answers = await asyncio.wait_for(asyncio.gather(*waiting), 10)
        assert [set(a.samples[0].token_versions) for a in answers] == [{1}] * 4
        assert servicer.in_flight == servicer.version_waiters == 0 and not engine._version_listeners
        # and the lead counts from the version loaded now
        waits = asyncio.create_task(servicer.Generate(_small(1 + 64), Context()))
        await asyncio.sleep(0.05)
        assert not waits.done()
        waits.cancel()
        await asyncio.gather(waits, return_exceptions=True)
        refused = await _refused(servicer.Generate(_small(1 + 65), Context()))
        assert refused.code == grpc.StatusCode.UNAVAILABLE and "version 1," in refused.details

    asyncio.run(main())


# -- weights -----------------------------------------------------------------------------------------------


def _update(**fields: Any) -> pb.UpdateWeightsFromDistributedRequest:
    request = pb.UpdateWeightsFromDistributedRequest(
        names=["model.embed_tokens.weight"],
        dtypes=["float32"],
        shapes=[pb.TensorShape(dims=[16, 32])],
        group_name="g-e1",
        policy_version=1,
        membership_epoch=1,
        bucket_index=0,
        bucket_count=1,
        manifest_checksum="ab",
    )
    for name, value in fields.items():
        setattr(request, name, value)
    return request


@pytest.fixture
def sender() -> Iterator[tuple[StoreHost, list[WeightGroup]]]:
    """A store for weight groups, and the groups formed on it as rank 0 (the sidecar's part)."""
    host = StoreHost("127.0.0.1", 0, timeout_s=30)
    groups: list[WeightGroup] = []
    yield host, groups
    for g in groups:
        g.destroy()


def test_refused_weight_buckets_ask_the_sidecar_nothing_and_change_nothing(
    engine: HFEngine, model_dir: Path, sender: tuple[StoreHost, list[WeightGroup]]
) -> None:
    sidecar = Sidecar(known=())
    servicer = _servicer(engine, model_dir, sidecar)
    loader = servicer.weights
    host, groups = sender

    async def main() -> None:
        # no group held: every version the sidecar never heard of, and a bucket index past the count
        for version in (1, 7, 123456):
            refused = await _refused(servicer.UpdateWeightsFromDistributed(_update(policy_version=version), Context()))
            assert refused.code == grpc.StatusCode.FAILED_PRECONDITION and "InitWeightsUpdateGroup" in refused.details
        refused = await _refused(
            servicer.UpdateWeightsFromDistributed(_update(bucket_index=5, bucket_count=1), Context())
        )
        assert refused.code == grpc.StatusCode.INVALID_ARGUMENT and "bucket_index" in refused.details
        assert sidecar.asked == [] and loader._load_started == {} and loader._checksum_algorithms == {}

        # joined to a group: another epoch, or a bucket out of order, is refused before the sidecar is asked
        spec = GroupSpec("127.0.0.1", host.port, "g-e1", 2, 0, "gloo", 1, 10.0)
        formed = threading.Thread(target=lambda: groups.append(WeightGroup(host.store, spec)))
        formed.start()
        init = pb.InitWeightsUpdateGroupRequest(
            master_address="127.0.0.1",
            master_port=host.port,
            rank_offset=1,
            world_size=2,
            group_name="g-e1",
            backend="gloo",
            membership_epoch=1,
            timeout=Duration(seconds=10),
        )
        assert (await servicer.InitWeightsUpdateGroup(init, Context())).num_ranks == 1
        formed.join(10)
        for request, code in [
            (_update(membership_epoch=2), grpc.StatusCode.FAILED_PRECONDITION),
            (_update(bucket_index=1, bucket_count=2), grpc.StatusCode.FAILED_PRECONDITION),
        ]:
            assert (await _refused(servicer.UpdateWeightsFromDistributed(request, Context()))).code == code
        assert sidecar.asked == []

        # a version the sidecar holds no manifest of: FAILED_PRECONDITION; a sidecar that does not answer:
        # UNAVAILABLE. Neither leaves anything behind.
        refused = await _refused(servicer.UpdateWeightsFromDistributed(_update(policy_version=7), Context()))
        assert refused.code == grpc.StatusCode.FAILED_PRECONDITION and "no manifest of version 7" in refused.details
        sidecar.up = False
        refused = await _refused(servicer.UpdateWeightsFromDistributed(_update(policy_version=8), Context()))
        assert refused.code == grpc.StatusCode.UNAVAILABLE
        assert sidecar.asked == [7, 8] and loader._load_started == {} and loader._checksum_algorithms == {}
        assert loader.group is not None and loader.group.name == "g-e1" and engine.policy_version == 0

        # the algorithms remembered are bounded, however many (version, checksum) pairs are asked about
        sidecar.up, sidecar.known = True, (1,)
        for i in range(3 * CHECKSUM_ALGORITHMS_KEPT):
            assert await loader._checksum_algorithm(1, f"checksum-{i}") == "xxh3_128"
        assert len(loader._checksum_algorithms) == CHECKSUM_ALGORITHMS_KEPT

    asyncio.run(main())
    loader.forget_group()


def test_the_sidecar_client_names_an_unknown_version_and_an_unreachable_sidecar() -> None:
    from tauflow.rollout.adapters.weights_client import GrpcSidecar

    class Stub:
        def __init__(self, code: grpc.StatusCode) -> None:
            self.code = code

        async def GetManifest(self, request: Any, timeout: float | None = None) -> Any:
            assert timeout is not None  # never an unbounded wait
            raise grpc.aio.AioRpcError(self.code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="no")

    sidecar = GrpcSidecar.__new__(GrpcSidecar)
    sidecar.timeout_s = 1.0
    for code, error in [
        (grpc.StatusCode.NOT_FOUND, UnknownVersion),
        (grpc.StatusCode.UNAVAILABLE, SidecarUnavailable),
        (grpc.StatusCode.INTERNAL, SidecarUnavailable),
    ]:
        sidecar.stub = Stub(code)  # type: ignore[assignment]
        with pytest.raises(error):
            asyncio.run(sidecar.checksum_algorithm(3))


# -- policy versions ---------------------------------------------------------------------------------------


@pytest.fixture
def stager() -> DeviceStager:
    """The trainer's side of the colocated hand-off (its shared buffer lives as long as it does)."""
    return DeviceStager("cpu")


def _from_tensor(stager: DeviceStager, state_dict: dict[str, Any], version: int) -> pb.UpdateWeightsFromTensorRequest:
    """An UpdateWeightsFromTensor of ``state_dict`` as ``version``, in a shared buffer as the trainer stages it."""
    manifest, uri = stager.stage(state_dict, version)
    return shared_request_to_proto(shared_request(manifest, uri))


def test_a_policy_version_over_2_53_is_refused_on_every_path_and_nothing_changes(
    engine: HFEngine, model_dir: Path, reference: Any, stager: DeviceStager
) -> None:
    # 2**64 - 1 is a valid uint64: accepted, it became the served version and every Generate then failed (the
    # engine's per-token versions are int64). Refused now, as the queue refuses it, before anything is read.
    sidecar = Sidecar(known=(1,))
    servicer = _servicer(engine, model_dir, sidecar)
    generate = pb.GenerateRequest(prompt_token_ids=[1, 5], sampling=pb.SamplingParams(max_new_tokens=2))

    async def main() -> None:
        for version in (2**64 - 1, 2**63, MAX_POLICY_VERSION + 1):
            for call in (
                servicer.UpdateWeightsFromTensor(_from_tensor(stager, reference.state_dict(), version), Context()),
                servicer.UpdateWeightsFromTensor(pb.UpdateWeightsFromTensorRequest(policy_version=version), Context()),
                servicer.UpdateWeightsFromDistributed(_update(policy_version=version), Context()),
            ):
                refused = await _refused(call)
                assert refused.code == grpc.StatusCode.INVALID_ARGUMENT and "policy_version" in refused.details
        assert sidecar.asked == [] and servicer.weights._load_started == {}
        assert engine.policy_version == 0 and engine.newest_version == 0
        assert not engine.stats().weight_update_in_progress
        # the largest version is taken, and served, and a re-base goes back from it
        loaded = await servicer.UpdateWeightsFromTensor(
            _from_tensor(stager, reference.state_dict(), MAX_POLICY_VERSION), Context()
        )
        assert loaded.policy_version == MAX_POLICY_VERSION
        answer = await servicer.Generate(generate, Context())
        assert set(answer.samples[0].token_versions) == {MAX_POLICY_VERSION}
        assert (
            await servicer.UpdateWeightsFromTensor(_from_tensor(stager, reference.state_dict(), 1), Context())
        ).policy_version == 1
        assert set((await servicer.Generate(generate, Context())).samples[0].token_versions) == {1}

    asyncio.run(main())
    from tauflow.rollout.engine import WeightUpdateError

    for rebase in (False, True):  # the engine's own check, whoever stages
        with pytest.raises(WeightUpdateError, match="policy_version"):
            engine.stage_weights(2**64 - 1, reference.state_dict(), rebase=rebase)
    with pytest.raises(WeightUpdateError, match="policy_version"):
        engine.stage_broadcast(2**63, reference.state_dict())
    assert engine.newest_version == 1


# -- weight groups -----------------------------------------------------------------------------------------


def _dead_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nobody listens once it is closed


def test_a_group_build_holds_up_no_weight_load_and_one_build_runs_at_a_time(
    engine: HFEngine, model_dir: Path, reference: Any, stager: DeviceStager
) -> None:
    # An InitWeightsUpdateGroup naming a store nobody serves waits out its timeout (twice over, in torch's
    # connect). It ran on the weight thread: every load queued behind it, and behind any other such build.
    servicer = _servicer(engine, model_dir, max_wait_s=30)
    port = _dead_port()

    def init(name: str) -> pb.InitWeightsUpdateGroupRequest:
        return pb.InitWeightsUpdateGroupRequest(
            master_address="127.0.0.1",
            master_port=port,
            rank_offset=1,
            world_size=2,
            group_name=name,
            backend="gloo",
            membership_epoch=1,
            timeout=Duration(seconds=2),
        )

    async def main() -> None:
        build = asyncio.create_task(servicer.InitWeightsUpdateGroup(init("stuck"), Context()))
        await asyncio.sleep(0.3)
        started = time.monotonic()
        refused = await _refused(servicer.InitWeightsUpdateGroup(init("other"), Context()))
        assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "'stuck' is being built" in refused.details
        assert time.monotonic() - started < 1.0
        same = asyncio.create_task(servicer.InitWeightsUpdateGroup(init("stuck"), Context()))  # gets its outcome
        request = _from_tensor(stager, reference.state_dict(), 1)
        loaded = await asyncio.wait_for(servicer.UpdateWeightsFromTensor(request, Context()), 1.5)
        assert loaded.policy_version == 1 and engine.policy_version == 1 and not build.done()
        codes = {(await _refused(t)).code for t in (build, same)}
        assert len(codes) == 1 and codes <= {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED}
        assert servicer.weights._building is None and servicer.weights.group is None  # (another may start)

    asyncio.run(main())


def test_a_weight_load_whose_caller_gave_up_while_it_waited_loads_nothing(
    engine: HFEngine,
    model_dir: Path,
    reference: Any,
    stager: DeviceStager,
    sender: tuple[StoreHost, list[WeightGroup]],
) -> None:
    # A load queued behind another weight call (here: one holding the shared loads' thread) past its caller's
    # deadline used to be made anyway, after its caller had given up: it is not, and the version served stays.
    servicer = _servicer(engine, model_dir)
    loader = servicer.weights
    release = threading.Event()
    request = _from_tensor(stager, reference.state_dict(), 1)

    async def main() -> None:
        busy = asyncio.get_running_loop().run_in_executor(loader._shared_thread, release.wait, 30)
        late = asyncio.create_task(servicer.UpdateWeightsFromTensor(request, Context(time_remaining=0.2)))
        await asyncio.sleep(0.5)
        release.set()
        await busy
        refused = await _refused(late)
        assert refused.code == grpc.StatusCode.DEADLINE_EXCEEDED and "nothing was loaded" in refused.details
        await asyncio.sleep(0.2)
        assert engine.policy_version == 0 and engine.newest_version == 0
        # a bucket likewise: its receive is not posted for a version its sender has given up on
        host, groups = sender
        spec = GroupSpec("127.0.0.1", host.port, "g-e1", 2, 0, "gloo", 1, 10.0)
        formed = threading.Thread(target=lambda: groups.append(WeightGroup(host.store, spec)))
        formed.start()
        await loader.init_group(dataclasses.replace(spec, rank=1))
        formed.join(10)
        bucket_busy = asyncio.get_running_loop().run_in_executor(loader._receiver_thread, time.sleep, 0.5)
        refused = await _refused(servicer.UpdateWeightsFromDistributed(_update(), Context(time_remaining=0.2)))
        await bucket_busy
        assert refused.code == grpc.StatusCode.DEADLINE_EXCEEDED and loader.receiving_version is None
        # in time, it loads
        assert (await servicer.UpdateWeightsFromTensor(request, Context(time_remaining=10))).policy_version == 1

    asyncio.run(main())
    loader.forget_group()


# -- tokenizing --------------------------------------------------------------------------------------------


def test_text_is_tokenized_on_threads_of_its_own_and_a_text_surely_too_long_is_refused_untokenized(
    engine: HFEngine, model_dir: Path
) -> None:
    # Six clients sending 262,144 characters each took every thread of the default pool to tokenize texts the
    # context then refused; other clients' Generate waited behind them (17 ms -> 1.3-3.3 s).
    codec = Codec()
    servicer = _servicer(engine, model_dir, codec=codec)
    long_started, release = threading.Event(), threading.Event()
    encode = codec.encode

    def slow_for_long_texts(text: str) -> list[int]:
        if len(text) > LONG_TEXT_CHARS:
            long_started.set()
            release.wait(30)
        return encode(text)

    codec.encode = slow_for_long_texts  # type: ignore[method-assign]
    short = pb.GenerateRequest(prompt_text="12+34=", sampling=pb.SamplingParams(max_new_tokens=2))
    long = pb.GenerateRequest(prompt_text="7" * (LONG_TEXT_CHARS + 1), sampling=pb.SamplingParams(max_new_tokens=2))

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(1))
        default_busy = loop.run_in_executor(None, release.wait, 30)  # the default pool: held
        longs = [asyncio.create_task(servicer.Generate(long, Context())) for _ in range(3)]
        for _ in range(50):
            if long_started.is_set():
                break
            await asyncio.sleep(0.02)
        assert long_started.is_set()
        answer = await asyncio.wait_for(servicer.Generate(short, Context()), 5)  # not behind the long texts
        assert answer.prompt_token_ids == encode("12+34=")
        release.set()
        for task in longs:  # (64 tokens of context: the engine refuses them, once tokenized)
            assert (await _refused(task)).code == grpc.StatusCode.INVALID_ARGUMENT
        await default_busy

        # With a bound of characters per token, a text surely over the context is refused untokenized.
        codec.max_chars_per_token = 1
        codec.encoded.clear()
        over = pb.GenerateRequest(prompt_text="7" * 63, sampling=pb.SamplingParams(max_new_tokens=2))
        refused = await _refused(servicer.Generate(over, Context()))
        assert refused.code == grpc.StatusCode.INVALID_ARGUMENT and "at least 63 tokens" in refused.details
        assert codec.encoded == [] and servicer.in_flight == 0
        fits = pb.GenerateRequest(prompt_text="7" * 61, sampling=pb.SamplingParams(max_new_tokens=2))
        assert len((await servicer.Generate(fits, Context())).prompt_token_ids) == 62  # (and the BOS: 64 in all)

    asyncio.run(main())


def test_an_engine_whose_server_failed_the_request_answers_unavailable(
    engine: HFEngine, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (an SGLang server answering 503, or one that lost its weights: was UNKNOWN, a server bug to the client)
    from tauflow.rollout.engine import EngineUnavailableError

    async def failing(*args: Any, **kwargs: Any) -> Any:
        raise EngineUnavailableError("sglang-0 (http://10.0.0.5:30000) /generate: HTTP 503: no room")

    servicer = _servicer(engine, model_dir)
    monkeypatch.setattr(engine, "generate", failing)
    refused = asyncio.run(_refused(servicer.Generate(_small(0), Context())))
    assert refused.code == grpc.StatusCode.UNAVAILABLE and "HTTP 503" in refused.details
    assert servicer.in_flight == 0
