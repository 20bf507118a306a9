"""A run built as the trainer builds it (actor, engine, phases), then one weight sync, as a step ends with;
rank 0 prints the sync's scalars (what the step writes) as JSON on its last line.

    python tests/workers/sync_run_worker.py --config ... [overrides]
"""

import json
import sys

from megatron_dapo import parallel
from megatron_dapo.config import build_parser, load_config, validate
from megatron_dapo.loop.build import build_run

if __name__ == "__main__":
    args = build_parser().parse_intermixed_args(sys.argv[1:])
    cfg = load_config(args.config, args.overrides)
    validate(cfg, parallel.launch_env().world_size)
    run = build_run(cfg)
    try:
        run.phases.train()
        stats = run.phases.sync(step=1)
    finally:
        run.close()
    if run.is_driver:
        print(json.dumps(stats.scalars()))
