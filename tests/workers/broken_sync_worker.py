"""The trainer with a weight sync broken on purpose: one tensor reaches the engine scaled by 3 (a wrong
layout, a stale shard), so the weight-sync probe must stop the run after the first sync.

    python tests/workers/broken_sync_worker.py --config ... [overrides]
"""

import sys

from megatron_dapo import train
from megatron_dapo.loop import weight_sync

honest = weight_sync.hf_weight_stream


def scaled_stream(module, spec, dtype, **kw):
    for name, t in honest(module, spec, dtype, **kw):
        yield name, (t * 3 if name.endswith("layers.0.mlp.down_proj.weight") else t)


if __name__ == "__main__":
    weight_sync.hf_weight_stream = scaled_stream  # type: ignore[assignment]
    sys.exit(train.main(sys.argv[1:]))
