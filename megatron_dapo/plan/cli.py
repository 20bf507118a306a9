"""The planner's command line: `python -m megatron_dapo.plan --config ... --nodes N --gpus-per-node G`.

Exit 0: the plan fits; 1: refused (every reason listed); 2: the flags, the config or the model
cannot be read.
"""

from __future__ import annotations

import argparse
import json
import sys

from megatron_dapo.config import ConfigError, load_config
from megatron_dapo.plan.build import make_plan
from megatron_dapo.plan.core import Hardware, Links
from megatron_dapo.plan.models import PlanInputError, resolve_model
from megatron_dapo.plan.report import format_plan

EXIT_REFUSED = 1
EXIT_BAD_INPUT = 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_dapo.plan",
                                description="Plan a megatron-dapo run: layout, per-GPU memory, "
                                            "tokens per step; "
                                            "refuse layouts that cannot fit or do not divide (exit 1).")
    p.add_argument("--config", required=True, help="YAML config (deltas over the defaults)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.pipeline_parallel=2")
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, required=True)
    p.add_argument("--gpu-mem-gb", type=float, default=80.0,
                   help="memory per GPU in GiB (H100: 80, H200: 141)")
    p.add_argument("--reserve-gb", type=float, default=4.0,
                   help="per-GPU GiB set aside for the CUDA context, NCCL buffers and fragmentation")
    p.add_argument("--max-util", type=float, default=0.9,
                   help="refuse a phase that needs more than this fraction of GPU memory "
                        "(fragmentation headroom)")
    p.add_argument("--model-config", help="HF config.json (or its folder) to size the model from")
    p.add_argument("--rollout-concurrency", type=int, default=None,
                   help="check that this many worst-case sequences per SGLang engine fit the KV pool")
    p.add_argument("--nvlink-gbs", type=float, default=Links.nvlink, help="NVLink GB/s per GPU and direction")
    p.add_argument("--ib-gbs", type=float, default=Links.ib, help="InfiniBand GB/s per GPU (its NIC)")
    p.add_argument("--hbm-gbs", type=float, default=Links.hbm, help="GPU memory bandwidth, GB/s")
    p.add_argument("--bucket-overhead-ms", type=float, default=Links.bucket_overhead_s * 1e3,
                   help="per weight-sync bucket: HTTP round trip and SGLang's TP barrier (assumed)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_intermixed_args(argv)
    if (args.nodes < 1 or args.gpus_per_node < 1 or args.gpu_mem_gb <= 0 or args.reserve_gb < 0
            or not 0 < args.max_util <= 1 or min(args.nvlink_gbs, args.ib_gbs, args.hbm_gbs) <= 0
            or args.bucket_overhead_ms < 0):
        print("plan: --nodes and --gpus-per-node must be >= 1, --gpu-mem-gb > 0, --reserve-gb >= 0, "
              "--max-util in (0, 1], the bandwidths > 0, --bucket-overhead-ms >= 0", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        cfg = load_config(args.config, args.overrides)
        spec, source = resolve_model(cfg, args.model_config)
    except (ConfigError, PlanInputError) as e:
        print(f"plan: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    hw = Hardware(nodes=args.nodes, gpus_per_node=args.gpus_per_node, gpu_mem_gib=args.gpu_mem_gb,
                  reserve_gib=args.reserve_gb, max_util=args.max_util)
    links = Links(nvlink=args.nvlink_gbs, ib=args.ib_gbs, hbm=args.hbm_gbs,
                  bucket_overhead_s=args.bucket_overhead_ms / 1e3)
    plan = make_plan(cfg, spec, hw, model_source=source, config_name=args.config,
                     rollout_concurrency=args.rollout_concurrency, links=links)
    print(json.dumps(plan.to_dict(), indent=2) if args.json else format_plan(plan))
    if not plan.fits:
        if args.json:
            print("plan: REFUSED:\n  - " + "\n  - ".join(plan.problems), file=sys.stderr)
        return EXIT_REFUSED
    return 0
