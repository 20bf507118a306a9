"""The off-policy schedule: when the actor's weights reach the rollout engine, and which batch is generated
from which weights.

    schedule.py   the schedule of rollout.async_steps = k (k = 0: the synchronous loop), every rank's calls
    pipeline.py   the driver's producer thread of the next k batches, and the weight snapshots it hands over
"""

from megatron_dapo.schedule.schedule import Schedule

__all__ = ["Schedule"]
