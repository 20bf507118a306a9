"""Ablation studies: the paper's Table 1 (cumulative rows) and single-switch contrasts, several seeds,
an equal rollout budget per run (`spec`); the runs, resumable (`runner`); their curves (`curves`);
the table, contrasts, JSON and figure (`report`). The command line is tools/ablate.py:

    python tools/ablate.py --study dapo-small --jobs 2
"""

from megatron_dapo.study.spec import STUDIES, TABLE1, Contrast, Study, Variant, merged, table1_variants

__all__ = ["STUDIES", "TABLE1", "Contrast", "Study", "Variant", "merged", "table1_variants"]
