"""A run that cannot learn says so at its first step (issue 40): the line names what the responses scored and the
likely fix; step 1's sampled responses are written whatever logging.samples_every says."""

from megatron_dapo.loop.monitors import why_no_signal
from megatron_dapo.types import Group, Prompt, Sample

PROMPT = Prompt(uid="t/0", messages=({"role": "user", "content": "1+1"},), ground_truth="2")


def _group(*preds: str | None, truth: str = "2") -> Group:
    return Group(PROMPT, [Sample(prompt_ids=[1], response_ids=[2], rollout_logprobs=[0.0], finish_reason="stop",
                                 pred=p, acc=p == truth) for p in preds])


def test_no_answer_in_the_rewarded_form_names_the_template_and_the_fallback():
    line = why_no_signal([_group(None, None, "3", None), _group(None, None, None, None)], "none")
    assert "0 of 8 responses correct, 7 gave no answer" in line and "0 of 2 groups all correct" in line
    assert "data.prompt_template" in line and "reward.answer_fallback=boxed" in line
    assert "answer_fallback" not in why_no_signal([_group(None, None)], "boxed")


def test_wrong_answers_and_solved_groups_name_their_own_fixes():
    assert "easier task" in why_no_signal([_group("3", "4"), _group("5", "5")], "none")
    solved = why_no_signal([_group("2", "2"), _group("2", "2")], "none")
    assert "4 of 4 responses correct" in solved and "harder prompts" in solved
    assert "algo.group_size" in why_no_signal([_group("2", "2"), _group("3", "3")], "none")


def test_step_1_writes_its_samples_whatever_samples_every_says():
    from megatron_dapo.config import load_config
    from megatron_dapo.loop.state import RunState

    for every, due in ((0, [1]), (5, [1, 5, 10])):
        cfg = load_config(None, [f"logging.samples_every={every}"])
        run = RunState.__new__(RunState)
        run.cfg = cfg
        assert [s for s in range(1, 11) if RunState.wants_samples(run, s)] == due
