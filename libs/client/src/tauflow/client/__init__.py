"""tauflow-client: feed trajectories from a program outside tauflow (see libs/client/README.md).

queue = QueueClient("queue-host:50061", token)           # the queue's external port
rollout = RolloutClient("rollout-host:50052")
with queue.reservation(1) as ticket:
    [c] = rollout.generate(prompt, max_new_tokens=16, min_policy_version=ticket.min_policy_version)
    t = Trajectory(prompt); t.add_completion(c)
    queue.put(make_group([t.to_sample("0", reward=1.0)]), ticket)
"""

from tauflow.client.channel import Tls, open_channel
from tauflow.client.client import PutResult, QueueClient, RewardClient, RolloutClient, Ticket
from tauflow.client.errors import TauflowError
from tauflow.client.trajectory import Completion, Trajectory, make_group
from tauflow.media import PromptRow, load_prompt_rows  # the data set format of multimodal prompts (docs/omni.md)

__version__ = "0.1.0"
__all__ = [
    "Completion",
    "PromptRow",
    "PutResult",
    "QueueClient",
    "RewardClient",
    "RolloutClient",
    "TauflowError",
    "Ticket",
    "Tls",
    "Trajectory",
    "load_prompt_rows",
    "make_group",
    "open_channel",
]
