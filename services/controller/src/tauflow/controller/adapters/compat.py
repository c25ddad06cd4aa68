"""The controller's check of its peers: each role must serve the contract the controller speaks to it.

Run at start, right after each service is up, and again after every restart (a restart is how a rolling
upgrade replaces a role), so that a role replaced by an incompatible build stops the run at once with a
message naming both versions, instead of failing later on a missing field (docs/contracts.md).
"""

from __future__ import annotations

from typing import Any

import grpc

from tauflow.api.queue.v1 import queue_pb2
from tauflow.api.reward.v1 import reward_pb2
from tauflow.api.rollout.v1 import rollout_pb2
from tauflow.api.trainer.v1 import trainer_pb2
from tauflow.api.weights.v1 import weights_pb2
from tauflow.controller import __version__
from tauflow.controller.launcher import LaunchFailed
from tauflow.controller.ports import PeerUnavailable
from tauflow.core.channel import create_channel
from tauflow.core.serverinfo import SERVICE, IncompatibleService, Requirement, check_compatible, fetch_server_info

PEER = f"tauflow-controller {__version__}"

# What this controller needs of each role: the v1 contracts at their first revision (it uses nothing
# added since). Raise a revision here when the controller starts to use something a later one added.
REQUIREMENTS: dict[str, Requirement] = {
    "queue": Requirement.of("queue", queue_pb2.DESCRIPTOR.services_by_name["QueueService"]),
    "reward": Requirement.of("reward", reward_pb2.DESCRIPTOR.services_by_name["RewardService"]),
    "rollout": Requirement.of("rollout", rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"]),
    "trainer": Requirement.of("trainer", trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"]),
    "weights": Requirement.of("weights", weights_pb2.DESCRIPTOR.services_by_name["WeightsService"]),
    # a teacher for on-policy distillation: a rollout server that scores (ComputeLogprobs, revision 3)
    "teacher": Requirement.of(
        "rollout",
        rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"],
        revisions={"tauflow.api.rollout.v1": 3},
    ),
    # an LLM judge that the reward's genrm asks with chats (GenerateRequest.prompt_messages, revision 5)
    "judge": Requirement.of(
        "rollout",
        rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"],
        revisions={"tauflow.api.rollout.v1": 5},
    ),
}


class IncompatiblePeer(LaunchFailed):
    """A role's server is not one this controller can talk to: the run fails (exit 1) with the message."""


async def check_peer(
    role: str,
    address: str,
    records: dict[str, dict[str, Any]],
    name: str = "",
    follower: bool = False,
    timeout_s: float = 30.0,
) -> dict[str, Any]:
    """The run's CheckPeer port: asks the service of ``role`` at ``address`` what it is; raises
    IncompatiblePeer when this controller cannot talk to it. Records the answer in ``records[name or role]``
    (the run summary's ``services``, by process: ``rollout-1`` is a process of role ``rollout``):
    build_version, contracts (package -> revision), checks (how often it was checked). A ``follower`` (a
    trainer rank other than 0) serves no contract of its role, only health and ServerInfo: its role is checked."""
    try:
        async with create_channel(address, [SERVICE]) as channel:
            info = await fetch_server_info(channel, address, timeout_s=timeout_s)
        need = Requirement(role, {}) if follower else REQUIREMENTS[role]
        check_compatible(info, need, address=address, peer=PEER)
    except IncompatibleService as e:
        raise IncompatiblePeer(str(e)) from e
    except grpc.aio.AioRpcError as e:  # (it died again, or hangs: the launcher's restarts take it from here)
        raise PeerUnavailable(role, e.code().name, e.details() or "") from e
    record = records.setdefault(name or role, {"checks": 0})
    record["build_version"] = info.build_version
    record["contracts"] = {c.package: c.revision for c in info.contracts}
    record["checks"] += 1
    return record
