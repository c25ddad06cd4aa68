"""``remote_rm``'s protocol tauflow: the ``Score`` of another tauflow reward service (one channel per worker
process, from the channel factory, whose policy retries UNAVAILABLE: Score is idempotent)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from urllib.parse import urlsplit

import grpc

from tauflow.api.common.v1 import common_pb2
from tauflow.api.reward.v1 import reward_pb2, reward_pb2_grpc
from tauflow.core.channel import create_sync_channel
from tauflow.reward.api import SampleInput

SERVICE = reward_pb2.DESCRIPTOR.services_by_name["RewardService"]
_stubs: dict[str, reward_pb2_grpc.RewardServiceStub] = {}
_lock = threading.Lock()


class ScoreFailed(Exception):
    """The remote Score call failed (its status code's name is the message)."""


def _stub(url: str) -> reward_pb2_grpc.RewardServiceStub:
    with _lock:
        if url not in _stubs:
            # (another service, maybe another cluster's: it never sees this run's token)
            channel = create_sync_channel(urlsplit(url).netloc, [SERVICE], send_run_token=False)
            _stubs[url] = reward_pb2_grpc.RewardServiceStub(channel)
        return _stubs[url]


def score_remotely(
    url: str,
    reward_fn: str,
    group_id: str,
    prompt_id: str,
    group_metadata: dict[str, str],
    samples: Sequence[SampleInput],
    timeout_s: float,
) -> list[tuple[bool, float, dict[str, float]]]:
    """One Score of ``samples`` as one group at the reward service ``grpc://host:port``: per sample, whether
    the remote scored it (status OK), its score and its components."""
    request = reward_pb2.ScoreRequest(
        reward_fn=reward_fn,
        groups=[
            common_pb2.Group(
                group_id=group_id,
                prompt_id=prompt_id,
                metadata=group_metadata,
                samples=[
                    common_pb2.Sample(
                        sample_id=s.sample_id, completion_text=s.completion_text, metadata=dict(s.metadata)
                    )
                    for s in samples
                ],
            )
        ],
    )
    try:
        reply = _stub(url).Score(request, timeout=timeout_s)
    except grpc.RpcError as e:
        raise ScoreFailed(f"Score answered {e.code().name}") from None
    got = reply.groups[0].samples if len(reply.groups) == 1 else []
    return [
        (s.reward.status == common_pb2.REWARD_STATUS_OK, s.reward.score, dict(s.reward.components.items())) for s in got
    ]
