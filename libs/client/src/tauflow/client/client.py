"""Blocking clients of the three services an outside producer talks to.

- ``QueueClient``: the queue's external port, with the client's bearer token: the policy version,
  reservations, puts.
- ``RolloutClient``: ``RolloutService.Generate``, sampling from the current policy.
- ``RewardClient``: ``RewardService.Score``, for a producer that does not compute its own reward.

Every call has a deadline (``timeout_s``, per client and per call); only the calls the contract marks
idempotent are retried (on UNAVAILABLE, by the channel); every failure is a ``TauflowError``, an answer
that breaks its contract included (INTERNAL: e.g. a Score answer whose groups are not the request's, a Put
answer with no outcome). The token goes to the queue only.

Each client takes answers up to ``max_receive_bytes`` (over it: RESOURCE_EXHAUSTED): ``QueueClient``
``SMALL_ANSWER_BYTES`` (4 MiB; its answers are under a KiB), ``RolloutClient`` and ``RewardClient``
``DEFAULT_MAX_MESSAGE_BYTES`` (256 MiB, what the services may send), as their answers grow with the request
(``n`` completions; one reward per sample, each up to ~70 KB by the contract: 64 named components and a
500-character message).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any, Self, TypeVar

import grpc
from google.protobuf import duration_pb2, struct_pb2

from tauflow.api.common.v1 import common_pb2
from tauflow.api.queue.v1 import queue_pb2, queue_pb2_grpc
from tauflow.api.reward.v1 import reward_pb2, reward_pb2_grpc
from tauflow.api.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from tauflow.client.channel import DEFAULT_MAX_MESSAGE_BYTES, SMALL_ANSWER_BYTES, Tls, open_channel
from tauflow.client.errors import TauflowError
from tauflow.client.trajectory import Completion

T = TypeVar("T")
QUEUE = queue_pb2.DESCRIPTOR.services_by_name["QueueService"]
ROLLOUT = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"]
REWARD = reward_pb2.DESCRIPTOR.services_by_name["RewardService"]


def _duration(seconds: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(max(seconds, 0.0) * 1e9))
    return d


class _Client:
    def __init__(self, channel: grpc.Channel, timeout_s: float) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, not {timeout_s}")
        self.channel = channel
        self.timeout_s = timeout_s

    def _call(self, method: str, fn: Callable[..., T], request: Any, timeout_s: float | None, **kwargs: Any) -> T:
        try:
            return fn(request, timeout=timeout_s or self.timeout_s, **kwargs)
        except grpc.RpcError as e:
            raise TauflowError.of(method, e) from None

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class Ticket:
    """Room for ``n_groups`` groups in the queue. Generate them with weights of at least
    ``min_policy_version`` (pass it to ``RolloutClient.generate``) and put them with the ticket: they are
    then never too stale to train on. Unused room is released at ``expires_at`` (Unix time) or by
    ``QueueClient.release``."""

    ticket_id: str
    n_groups: int
    min_policy_version: int
    expires_at: float


@dataclass(frozen=True)
class PutResult:
    accepted: bool
    """False: a group of that id was accepted before (a retry); nothing changed."""
    depth_groups: int


class QueueClient(_Client):
    """The queue's external port. ``token`` is this client's bearer token (the queue's tokens file names
    the client it belongs to); ``tls`` when the port speaks TLS; ``max_message_bytes`` the largest Put it
    sends, ``max_receive_bytes`` the largest answer it takes (its answers are under a KiB)."""

    def __init__(
        self,
        address: str,
        token: str,
        *,
        tls: Tls | None = None,
        timeout_s: float = 30.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_receive_bytes: int = SMALL_ANSWER_BYTES,
    ) -> None:
        if not token:
            raise ValueError("a token is needed: the external port refuses calls without one")
        channel = open_channel(
            address, [QUEUE], tls=tls, max_message_bytes=max_message_bytes, max_receive_bytes=max_receive_bytes
        )
        super().__init__(channel, timeout_s)
        self._metadata = (("authorization", f"Bearer {token}"),)
        self._stub = queue_pb2_grpc.QueueServiceStub(self.channel)

    def _queue_call(self, method: str, request: Any, timeout_s: float | None = None) -> Any:
        return self._call(method, getattr(self._stub, method), request, timeout_s, metadata=self._metadata)

    def stats(self) -> queue_pb2.StatsResponse:
        """The queue's counters (``trainer_version``, ``max_staleness``, depth, ...)."""
        return self._queue_call("Stats", queue_pb2.StatsRequest())

    def policy_version(self) -> int:
        """The trainer's current policy version (optimizer steps committed)."""
        return int(self.stats().trainer_version)

    def reserve(self, n_groups: int = 1, *, wait_s: float = 30.0, request_id: str = "") -> Ticket | None:
        """A ticket for ``n_groups`` groups, or None when the queue had no room within ``wait_s`` (the
        trainer is behind: pacing). Retried safely: ``request_id`` (random by default) makes the call
        idempotent, a repeat returns the same ticket."""
        request = queue_pb2.ReserveRequest(
            request_id=request_id or uuid.uuid4().hex, n_groups=n_groups, wait=_duration(wait_s)
        )
        response = self._queue_call("Reserve", request, timeout_s=wait_s + self.timeout_s)
        if not response.granted:
            return None
        t = response.ticket
        return Ticket(t.ticket_id, t.n_groups, t.min_policy_version, t.expires_at.ToNanoseconds() / 1e9)

    def release(self, ticket: Ticket) -> int:
        """Gives the unused room of ``ticket`` back; returns the groups released."""
        response = self._queue_call(
            "ReleaseReservation", queue_pb2.ReleaseReservationRequest(ticket_id=ticket.ticket_id)
        )
        return int(response.released_groups)

    @contextmanager
    def reservation(self, n_groups: int = 1, *, wait_s: float = 300.0, poll_s: float = 30.0) -> Iterator[Ticket]:
        """A ticket for the block, waiting up to ``wait_s`` for room (TimeoutError when none came); the
        room that the block did not fill is released at its end, also when it raises."""
        deadline = time.monotonic() + wait_s
        request_id = uuid.uuid4().hex
        ticket = None
        while ticket is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"the queue granted no room for {n_groups} group(s) within {wait_s:.0f}s: the trainer is "
                    "behind (pacing), or the queue is full"
                )
            ticket = self.reserve(n_groups, wait_s=min(left, poll_s), request_id=request_id)
        try:
            yield ticket
        except BaseException:
            with suppress(TauflowError):  # the block's error is the one to see
                self.release(ticket)
            raise
        try:
            self.release(ticket)  # releasing a filled ticket releases nothing
        except TauflowError as e:
            if e.code is not grpc.StatusCode.NOT_FOUND:  # NOT_FOUND: expired, its room went back already
                raise

    def put(self, group: common_pb2.Group, ticket: Ticket | None = None) -> PutResult:
        """Puts ``group`` (durable in the queue when this returns). With the ticket it was generated for,
        it counts against the ticket's room; without one it is subject to stale eviction only. Retried
        safely: the group id makes the call idempotent."""
        request = queue_pb2.PutRequest(group=group, ticket_id=ticket.ticket_id if ticket else "")
        response = self._queue_call("Put", request)
        if response.outcome not in (queue_pb2.PUT_OUTCOME_ACCEPTED, queue_pb2.PUT_OUTCOME_DUPLICATE):
            # (UNSPECIFIED, e.g. an empty answer, says neither "accepted" nor "put before": not a duplicate)
            raise TauflowError(
                "Put",
                grpc.StatusCode.INTERNAL,
                f"the answer's outcome is {_outcome_name(response.outcome)}, neither ACCEPTED nor DUPLICATE: "
                "whether the group was taken is unknown",
            )
        return PutResult(response.outcome == queue_pb2.PUT_OUTCOME_ACCEPTED, int(response.depth_groups))


class RolloutClient(_Client):
    """``RolloutService.Generate``. Its port is tauflow's internal rollout port (no token): reach it
    over a network you trust. ``max_receive_bytes``: the largest answer it takes (an answer grows with
    ``n`` and the tokens generated; by default what the service may send)."""

    def __init__(
        self,
        address: str,
        *,
        tls: Tls | None = None,
        timeout_s: float = 120.0,
        max_receive_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        super().__init__(open_channel(address, [ROLLOUT], tls=tls, max_receive_bytes=max_receive_bytes), timeout_s)
        self._stub = rollout_pb2_grpc.RolloutServiceStub(self.channel)

    def generate(
        self,
        prompt_token_ids: Sequence[int],
        *,
        n: int = 1,
        max_new_tokens: int,
        min_policy_version: int = 0,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        stop_token_ids: Sequence[int] = (),
        seed: int | None = None,
        timeout_s: float | None = None,
    ) -> list[Completion]:
        """``n`` completions of the prompt by the current policy, with each token's log-prob and version.
        ``min_policy_version``: wait (within the deadline) for an engine with at least that version; pass
        the ticket's. Not retried: a retry would be a new draw."""
        sampling = rollout_pb2.SamplingParams(
            n=n,
            max_new_tokens=max_new_tokens,
            stop_token_ids=stop_token_ids,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
        )
        request = rollout_pb2.GenerateRequest(
            request_id=uuid.uuid4().hex,
            prompt_token_ids=prompt_token_ids,
            sampling=sampling,
            min_policy_version=min_policy_version,
        )
        response = self._call("Generate", self._stub.Generate, request, timeout_s)
        return [Completion.from_proto(s) for s in response.samples]


class RewardClient(_Client):
    """``RewardService.Score``. Its port is tauflow's internal reward port (no token).
    ``max_receive_bytes``: the largest answer it takes. A Score answer holds one reward per sample sent (up
    to ~70 KB each by the contract, typically tens of bytes), so it grows with the request: by default the
    limit is what the service may send; a program that scores small batches may lower it."""

    def __init__(
        self,
        address: str,
        *,
        tls: Tls | None = None,
        timeout_s: float = 120.0,
        max_receive_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        super().__init__(open_channel(address, [REWARD], tls=tls, max_receive_bytes=max_receive_bytes), timeout_s)
        self._stub = reward_pb2_grpc.RewardServiceStub(self.channel)

    def score(
        self,
        groups: Sequence[common_pb2.Group],
        *,
        reward_fn: str = "",
        config: Mapping[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> str:
        """Scores every sample of ``groups`` with ``reward_fn`` (the service's default when empty) and sets
        each sample's ``reward`` in place; returns the function's name. A sample whose reward function
        failed gets the function's fallback score and a status that says so. An answer whose groups or
        samples do not match the request's, one for one, is a ``TauflowError`` (INTERNAL), and no reward is
        set then."""
        request = reward_pb2.ScoreRequest(groups=groups, reward_fn=reward_fn)
        if config:
            request.config.CopyFrom(_struct(config))
        response = self._call("Score", self._stub.Score, request, timeout_s)
        _check_shape(groups, response)  # before any reward is written: a bad answer changes nothing
        for group, scored in zip(groups, response.groups, strict=True):
            for sample, reward in zip(group.samples, scored.samples, strict=True):
                sample.reward.CopyFrom(reward.reward)
        return response.reward_fn


def _check_shape(groups: Sequence[common_pb2.Group], response: reward_pb2.ScoreResponse) -> None:
    """The answer has one entry per group sent and, in each, one per sample (the contract's order)."""

    def bad(what: str) -> TauflowError:
        return TauflowError("Score", grpc.StatusCode.INTERNAL, f"the answer does not match the request: {what}")

    if len(response.groups) != len(groups):
        raise bad(f"{len(response.groups)} group(s) for the {len(groups)} sent")
    for i, (group, scored) in enumerate(zip(groups, response.groups, strict=True)):
        if len(scored.samples) != len(group.samples):
            raise bad(f"groups[{i}] has {len(scored.samples)} reward(s) for its {len(group.samples)} sample(s)")


def _outcome_name(outcome: int) -> str:
    try:
        return queue_pb2.PutOutcome.Name(outcome)
    except ValueError:
        return str(outcome)


def _struct(values: Mapping[str, Any]) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    s.update(dict(values))
    return s
