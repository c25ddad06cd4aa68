"""Bounds on the contracts' values that more than one role checks: the queue refuses a group beyond them at
Put (INVALID_ARGUMENT naming the field), and the trainer skips one that reached it anyway (a queue of an
earlier build, a log written before the bound)."""

from __future__ import annotations

# |Reward.score| and |Group.baseline_reward|: far beyond any reward function's or reward model's scale, and
# small enough that a batch's squares and sums stay finite (a score of 1.7e308 made a step's advantages, loss
# and every group's update NaN).
MAX_ABS_REWARD = 1e9
