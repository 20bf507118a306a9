"""The driver's collection of one training step's groups from a rollout engine.

    collector.py  the engine, prompt source, scorer and carry put together: step s's groups on version v
    rounds.py     synchronous rounds of generate + score until dynamic sampling holds N groups
    streaming.py  the same on a stream of groups, aborting the rest; partial rollout's carry (carry.py)
    scoring.py    what both share with the evaluation: rendered prompts, scoring a finished group
    seeds.py      every generation's sampling parameters and seed
    versions.py   which policy version made which tokens; staleness
    result.py     what a collector hands over, and its monitors

When the collection runs, and on which weights, is the schedule's (megatron_dapo/schedule/).
"""

from megatron_dapo.collect.collector import Collector
from megatron_dapo.collect.result import StepRollout
from megatron_dapo.collect.scoring import GroupScorer, PromptSource

__all__ = ["Collector", "GroupScorer", "PromptSource", "StepRollout"]
