from megatron_dapo import ablation as ablate
from megatron_dapo.config import load_config


def test_rows_are_cumulative_and_end_at_dapo():
    naive = load_config(None, ablate.row_overrides(0))
    assert (naive.algo.eps_high, naive.algo.loss_agg_mode, naive.algo.overlong_filtering,
            naive.reward.soft_overlong_punishment, naive.algo.dynamic_sampling) == \
        (0.2, "seq-mean-token-mean", False, False, False)
    dapo = load_config(None, ablate.row_overrides(len(ablate.ROWS) - 1))
    assert (dapo.algo.eps_high, dapo.algo.loss_agg_mode, dapo.algo.overlong_filtering,
            dapo.reward.soft_overlong_punishment, dapo.algo.dynamic_sampling) == \
        (0.28, "token-mean", True, True, True)
    clip = load_config(None, ablate.row_overrides(2))
    assert clip.algo.eps_high == 0.28 and clip.algo.loss_agg_mode == "seq-mean-token-mean"


def test_table_reports_mean_and_std():
    results = [{"row": 0, "final": 0.5, "steps_to_target": 4}, {"row": 0, "final": 0.7, "steps_to_target": None}]
    md = ablate.table(results, seeds=[1, 2], target=0.6)
    assert "| naive GRPO | 0.600 ± 0.141 | 4.000 ± 0.000 (1/2) |" in md
