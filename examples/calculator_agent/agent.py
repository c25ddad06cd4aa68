"""A multi-turn calculator agent outside tauflow: it samples from a run's policy, runs a calculator tool,
and puts its trajectories into the run's queue through the queue's external port (tauflow-client).

The task: the sum of two-digit numbers (``--terms``, 2 by default). The prompt is the problem without its
``=``, e.g. ``<s>12+34``; the policy is the addition model of examples/addition, whose characters are the
vocabulary (digits, ``+``, ``=``).

- A model turn ends at ``=`` (a calculator call), at ``</s>`` (the final answer) or at its token limit.
- A call: the calculator sums the ``+`` expression that ends at that ``=`` (the text since the previous
  ``=``, so a tool result can be added to: ``12+34=46+56=``) and appends the result's digits as tool
  output: context for the next turn, masked out of the loss. Then the model goes on.
- The answer is what the last turn wrote before ``</s>``, or the last tool result when it wrote nothing
  but ``</s>``. Reward: 1 when it is the sum; otherwise ``--tool-bonus`` (0.1) when the episode called
  the calculator, else 0 (a shaped reward, so that a model that never called the tool finds it). Or,
  with ``--reward-service``, the reward service's ``exact_match`` (1 or 0).

Every group is reserved before it is generated (the ticket's version goes to every Generate call, so the
group is never too stale to train on), then put with its ticket. Usage: README.md beside this file.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tauflow.client import (
    Completion,
    QueueClient,
    RewardClient,
    RolloutClient,
    TauflowError,
    Tls,
    Trajectory,
    make_group,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "addition"))
from task import BOS, EOS, VOCAB  # the addition model's character vocabulary

CHARS = {i: c for c, i in VOCAB.items() if len(c) == 1}
EQ, EOS_ID = VOCAB["="], VOCAB[EOS]


def encode(text: str) -> list[int]:
    return [VOCAB[c] for c in text]


def decode(ids: list[int]) -> str:
    return "".join(CHARS.get(i, "") for i in ids)  # special tokens are not text


def calculator(context: str) -> str:
    """The tool: the sum of the ``+`` expression before the final ``=`` (back to the previous ``=``).
    It reads digits and ``+`` signs only; an expression with no number is 0."""
    expression = context[:-1].rpartition("=")[2]
    return str(sum(int(term) for term in expression.split("+") if term.isdigit()))


@dataclass
class Episode:
    trajectory: Trajectory
    answer: str | None  # None: no final answer (a turn ran out of tokens or of context)
    tool_calls: int


def play(
    rollout: RolloutClient, first: Completion, prompt: list[int], args: argparse.Namespace, min_version: int
) -> Episode:
    """Runs one episode from its first model turn: tool calls until the model answers or runs out."""
    t = Trajectory(prompt)
    t.add_completion(first)
    turn, calls, last_tool = first, 0, ""
    while turn.token_ids and turn.token_ids[-1] == EQ and calls < args.max_tool_calls:
        output = encode(calculator(decode(t.context)))
        room = args.context - len(t.context) - len(output)
        if room < 1:
            break  # no room left to answer: the episode ends without one
        t.add_observation(output)
        calls, last_tool = calls + 1, decode(output)
        [turn] = rollout.generate(
            t.context,
            max_new_tokens=min(args.turn_tokens, room),
            stop_token_ids=[EQ],
            temperature=args.temperature,
            min_policy_version=min_version,
        )
        t.add_completion(turn)
    answer = None
    if turn.token_ids and turn.token_ids[-1] == EOS_ID:
        answer = decode(turn.token_ids[:-1]) or last_tool or None
    return Episode(t, answer, calls)


def run_group(
    rollout: RolloutClient, reward: RewardClient | None, problem: list[int], args: argparse.Namespace, min_version: int
):
    """One group: ``group_size`` episodes of one problem, scored."""
    text = "+".join(map(str, problem))
    prompt = [VOCAB[BOS], *encode(text)]
    # The first turn of every episode shares the prompt: one call draws them all.
    firsts = rollout.generate(
        prompt,
        n=args.group_size,
        max_new_tokens=min(args.turn_tokens, args.context - len(prompt)),
        stop_token_ids=[EQ],
        temperature=args.temperature,
        min_policy_version=min_version,
    )
    with ThreadPoolExecutor(len(firsts)) as pool:  # the episodes' later turns are independent calls
        episodes = list(pool.map(lambda first: play(rollout, first, prompt, args, min_version), firsts))
    truth = str(sum(problem))

    def score(e: Episode) -> float:
        return 1.0 if e.answer == truth else args.tool_bonus if e.tool_calls else 0.0

    samples = [
        e.trajectory.to_sample(
            str(i), None if reward else score(e), text=e.answer or "", metadata={"tool_calls": str(e.tool_calls)}
        )
        for i, e in enumerate(episodes)
    ]
    group = make_group(samples, group_id=f"calc-{os.urandom(8).hex()}", prompt_id=text, metadata={"answer": truth})
    if reward is not None:
        reward.score([group], reward_fn="exact_match")  # compares completion_text (the answer) with "answer"
    return group


def addresses(args: argparse.Namespace) -> tuple[str, str, str]:
    """The queue's external port, the rollout and the reward service: given, or from a run's ready files."""
    if args.run_dir:

        def port(name: str, key: str) -> str:
            info = json.loads((Path(args.run_dir) / f"{name}.ready.json").read_text())
            if key not in info:
                sys.exit(f"{name} in {args.run_dir} has no {key}: start the run with the queue's external port on")
            return f"127.0.0.1:{info[key]}"

        return port("queue", "external_port"), port("rollout", "grpc_port"), port("reward", "grpc_port")
    if not (args.queue and args.rollout):
        sys.exit("give --run-dir, or --queue and --rollout (and --reward with --reward-service)")
    return args.queue, args.rollout, args.reward


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", help="a local run's folder (runs/addition): addresses from its ready files")
    p.add_argument("--queue", help="the queue's external port, host:port")
    p.add_argument("--rollout", help="the rollout service, host:port")
    p.add_argument("--reward", default="", help="the reward service, host:port")
    p.add_argument("--token-file", help="a file holding this client's token (else $TAUFLOW_TOKEN)")
    p.add_argument("--ca-file", help="the CA certificate of the queue's TLS port (PEM); unset: plaintext")
    p.add_argument("--groups", type=int, default=32, help="groups to put")
    p.add_argument("--terms", type=int, default=2, help="two-digit numbers to add")
    p.add_argument("--group-size", type=int, default=8, help="episodes per problem")
    p.add_argument("--turn-tokens", type=int, default=8, help="token limit of one model turn")
    p.add_argument("--max-tool-calls", type=int, default=3)
    p.add_argument("--context", type=int, default=32, help="the model's context (examples/addition: 32)")
    p.add_argument("--temperature", type=float, default=1.0, help="must be the run's temperature")
    p.add_argument("--tool-bonus", type=float, default=0.1, help="reward of a wrong answer that used the calculator")
    p.add_argument("--reward-service", action="store_true", help="score with the reward service's exact_match")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--record", help="append one JSON line per group put here")
    args = p.parse_args(argv)

    token = Path(args.token_file).read_text().strip() if args.token_file else os.environ.get("TAUFLOW_TOKEN", "")
    if not token:
        sys.exit("no token: --token-file FILE or TAUFLOW_TOKEN (the queue's tokens file holds it)")
    queue_address, rollout_address, reward_address = addresses(args)
    rng = random.Random(args.seed)
    tls = Tls.from_file(args.ca_file) if args.ca_file else None
    reward = RewardClient(reward_address) if args.reward_service else None
    with QueueClient(queue_address, token, tls=tls) as queue, RolloutClient(rollout_address) as rollout:
        try:
            version = queue.policy_version()
        except TauflowError as e:  # (the run has ended, or has not started: one line, not a traceback)
            where = f" ({args.run_dir})" if args.run_dir else ""
            print(f"agent: the queue's external port {queue_address} does not answer: is the run{where} training, "
                  f"with services.queue.external.enabled=true? {e}", file=sys.stderr)  # fmt: skip
            return 1
        print(f"policy version {version}; putting {args.groups} groups", flush=True)
        for n in range(args.groups):
            problem = [rng.randint(10, 99) for _ in range(args.terms)]
            started = time.monotonic()
            with queue.reservation(1) as ticket:
                group = run_group(rollout, reward, problem, args, ticket.min_policy_version)
                try:
                    result = queue.put(group, ticket)
                except TauflowError as e:
                    print(f"group {group.group_id} refused: {e}", file=sys.stderr)
                    return 1
            masks = [list(s.loss_mask) for s in group.samples]
            record = {
                "group_id": group.group_id,
                "accepted": result.accepted,
                "ticket_version": ticket.min_policy_version,
                "behaviour_version": min(s.behaviour_version for s in group.samples),
                "rewards": [s.reward.score for s in group.samples],
                "masked_tokens": sum(m.count(False) for m in masks),
                "trained_tokens": sum(
                    len(s.completion_token_ids) if not m else m.count(True)
                    for s, m in zip(group.samples, masks, strict=True)
                ),
            }
            print(
                f"[{n + 1}/{args.groups}] {group.group_id} {group.prompt_id}: reward "
                f"{sum(record['rewards']) / len(record['rewards']):.2f}, {record['masked_tokens']} tool tokens "
                f"masked, version {record['behaviour_version']}, {time.monotonic() - started:.1f}s",
                flush=True,
            )
            if args.record:
                with open(args.record, "a") as f:
                    f.write(json.dumps(record) + "\n")
    if reward is not None:
        reward.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
