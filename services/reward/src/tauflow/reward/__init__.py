"""tauflow reward service: scores whole groups with pluggable reward functions, each call bounded by a timeout.

Custom reward functions need only :mod:`tauflow.reward.api` (re-exported here).
"""

from tauflow.reward.api import ENTRY_POINT_GROUP, GroupInput, SampleInput, Score, reward

__version__ = "0.1.0"
__all__ = ["ENTRY_POINT_GROUP", "GroupInput", "SampleInput", "Score", "__version__", "reward"]
