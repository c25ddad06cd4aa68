"""A multimodal prompt through the rollout service and into the trainer (issue #15): Generate takes a prompt's
parts (rollout revision 4), the server's processor places them, and the trainer, given the same parts, scores
the generated tokens as the engine did (within 1e-4, temperature 1, no weight change); bad media and media
to a text model are refused with INVALID_ARGUMENT naming the part."""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pytest

from tauflow import media
from tauflow.api.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from tauflow.media import wire as media_wire
from tauflow.models import tiny
from tauflow.trainer.backend import TorchBackend, TorchBackendConfig
from tauflow.trainer.batch import Group, Sample, completion_logprobs, pack, unpack


@pytest.fixture(scope="module")
def omni(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-omni")
    tiny.build(out)
    return out


def _parts() -> list[media.PromptPart]:
    rng = np.random.default_rng(0)
    t = np.arange(int(0.5 * tiny.SAMPLE_RATE)) / tiny.SAMPLE_RATE
    return [
        media.image(rng.integers(0, 256, (56, 56, 3), dtype=np.uint8)),
        media.audio((0.3 * np.sin(2 * np.pi * 700 * t)).astype(np.float32), tiny.SAMPLE_RATE),
        media.video(np.stack([np.full((56, 56, 3), 40 * i, np.uint8) for i in range(4)]), fps=2),
        media.Text("3+4="),
    ]


def _stub(address: str) -> rollout_pb2_grpc.RolloutServiceStub:
    options = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    return rollout_pb2_grpc.RolloutServiceStub(grpc.insecure_channel(address, options=options))


def test_generate_takes_parts_and_the_trainer_scores_its_tokens_as_the_engine_did(service_process, omni: Path) -> None:
    rollout = service_process("rollout", {"model_path": str(omni), "seed": 0})
    stub = _stub(rollout.address)
    parts = _parts()
    request = rollout_pb2.GenerateRequest(
        prompt_parts=media_wire.to_proto(parts),
        sampling=rollout_pb2.SamplingParams(n=4, max_new_tokens=5, temperature=1.0, ignore_eos=True, seed=3),
    )
    reply = stub.Generate(request, timeout=120)
    prompt = list(reply.prompt_token_ids)
    assert len(reply.samples) == 4 and all(len(s.completion_token_ids) == 5 for s in reply.samples)
    backend = TorchBackend(TorchBackendConfig(model_path=str(omni)))
    samples = [Sample(prompt, list(s.completion_token_ids), list(s.behaviour_logprobs), sample_id=s.sample_id)
               for s in reply.samples]  # fmt: skip
    group = Group("g", samples, prompt_parts=parts)
    assert backend._attach_media([group]) == {}  # the trainer's processor made the same prompt tokens
    batch = pack(samples, banned_ids=backend.banned_ids)
    trainer = unpack(completion_logprobs(backend.model.eval(), batch).logprobs.detach(), samples)
    for s, mine in zip(samples, trainer, strict=True):
        assert mine == pytest.approx(s.behaviour_logprobs, abs=1e-4)


def test_bad_media_are_refused_naming_the_part(service_process, omni: Path) -> None:
    stub = _stub(service_process("rollout", {"model_path": str(omni)}).address)
    parts = media_wire.to_proto(_parts())
    parts[1].media.data = b"RIFF" + b"\0" * 40  # not a WAV
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(rollout_pb2.GenerateRequest(prompt_parts=parts), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_parts[1].media: the data does not decode as audio/wav" in (err.value.details() or "")
    parts = media_wire.to_proto(_parts())
    parts[0].media.media_type = "image/x-icon"
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(rollout_pb2.GenerateRequest(prompt_parts=parts), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_parts[0].media.media_type" in (
        err.value.details() or "")  # fmt: skip
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(rollout_pb2.GenerateRequest(prompt_parts=parts, prompt_text="x"), timeout=60)
    assert "exactly one of prompt_token_ids, prompt_text, prompt_parts and prompt_messages" in (
        err.value.details() or ""
    )


def test_a_text_model_refuses_prompt_parts(service_process, tmp_path: Path) -> None:
    # a text model has no processor: parts are refused, whatever they hold
    from tests.runs import tiny_addition

    model, _ = tiny_addition(tmp_path)
    text = _stub(service_process("rollout", {"model_path": str(model)}).address)
    with pytest.raises(grpc.RpcError) as err:
        text.Generate(rollout_pb2.GenerateRequest(prompt_parts=media_wire.to_proto(_parts())), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_parts needs a multimodal model" in (err.value.details() or "")
