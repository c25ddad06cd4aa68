"""``genrm``'s call of its judge: ``Generate`` on a tauflow rollout server, with a chat (rollout revision 5),
greedy (one channel per judge and worker process, from the channel factory)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import grpc

from tauflow.api.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from tauflow.core.channel import ChannelConfig, create_sync_channel

SERVICE = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"]
_stubs: dict[str, rollout_pb2_grpc.RolloutServiceStub] = {}
_lock = threading.Lock()


class JudgeFailed(Exception):
    """The judge's Generate failed (its status code's name is the message)."""


def _stub(address: str) -> rollout_pb2_grpc.RolloutServiceStub:
    with _lock:
        if address not in _stubs:
            _stubs[address] = rollout_pb2_grpc.RolloutServiceStub(
                create_sync_channel(address, [SERVICE], ChannelConfig())
            )
        return _stubs[address]


def judge_reply(
    address: str,
    messages: Sequence[tuple[str, str]],
    *,
    max_new_tokens: int,
    stop: Sequence[str],
    timeout_s: float,
    request_id: str = "",
) -> str:
    """The judge's greedy reply to the chat ``messages`` (role, content)."""
    request = rollout_pb2.GenerateRequest(
        request_id=request_id[:128],
        prompt_messages=[rollout_pb2.ChatMessage(role=role, content=content) for role, content in messages],
        sampling=rollout_pb2.SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens, stop=list(stop)),
    )
    try:
        reply = _stub(address).Generate(request, timeout=timeout_s)
    except grpc.RpcError as e:
        raise JudgeFailed(f"Generate answered {e.code().name}") from None
    return reply.samples[0].completion_text if reply.samples else ""
