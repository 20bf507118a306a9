"""A user reward for the tests (`reward.name=slow_reward:slow_once`): DAPO's rule, but the first call in a
process first sleeps $DAPO_TEST_REWARD_DELAY seconds (a rollout longer than a collective's timeout)."""

import os
import time

from megatron_dapo.reward.math_dapo import compute_score

_slept = False


def slow_once(response, ground_truth, sample):
    global _slept
    if not _slept:
        _slept = True
        time.sleep(float(os.environ.get("DAPO_TEST_REWARD_DELAY", "0")))
    return compute_score(response, ground_truth)
