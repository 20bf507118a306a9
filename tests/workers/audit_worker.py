"""The trainer under torchrun with every collective recorded (tests/collective_audit.py); each rank writes
its record to $DAPO_AUDIT_OUT/rank_<r>.json at the end.

    torchrun --nproc_per_node 2 tests/workers/audit_worker.py --config ... [overrides]
"""

import os
import sys
from pathlib import Path

import collective_audit

collective_audit.install()  # before megatron-core or the trainer import torch.distributed's functions

from megatron_dapo import train  # noqa: E402

if __name__ == "__main__":
    rank = os.environ["RANK"]
    try:
        code = train.main(sys.argv[1:])
    finally:
        collective_audit.save(Path(os.environ["DAPO_AUDIT_OUT"]) / f"rank_{rank}.json")
    sys.exit(code)
