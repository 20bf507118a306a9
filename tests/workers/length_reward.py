"""A user reward function for the tests (`reward.name=length_reward:even_length`): correct when the
response has an even number of tokens, its "answer" the length modulo 3; `flaky` raises on every
third length, to exercise failure counting."""

from megatron_dapo.reward import RewardResult


def even_length(response, ground_truth, sample):
    n = sample.response_len
    return RewardResult(score=1.0 if n % 2 == 0 else -1.0, acc=n % 2 == 0, pred=str(n % 3))


def flaky(response, ground_truth, sample):
    if sample.response_len % 3 == 0:
        raise RuntimeError(f"flaky reward refuses length {sample.response_len}")
    return even_length(response, ground_truth, sample)
