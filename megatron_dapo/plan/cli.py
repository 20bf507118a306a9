"""The planner's command line: `python -m megatron_dapo.plan --config ... --nodes N --gpus-per-node G`.

rollout.colocate=false with SGLang: the cluster is split into training and generation GPUs
(plan/split.py) and each split's step time estimated (plan/cost.py, flags --peak-tflops ...).
Exit 0: the plan fits; 1: refused (every reason listed); 2: the flags, the config or the model
cannot be read.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from megatron_dapo.config import Config, ConfigError, load_config
from megatron_dapo.plan.build import make_plan
from megatron_dapo.plan.core import Hardware, Links
from megatron_dapo.plan.cost import Throughput, Workload
from megatron_dapo.plan.models import PlanInputError, resolve_model
from megatron_dapo.plan.report import format_plan
from megatron_dapo.plan.split import is_disaggregated, plan_disaggregated
from megatron_dapo.plan.split_report import format_disaggregated

if TYPE_CHECKING:
    from megatron_dapo.actor.model import ModelSpec

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
    _time_arguments(p)
    return p


def _time_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("step-time estimate of a disaggregated split (rollout.colocate=false)")
    g.add_argument("--peak-tflops", type=float, default=Throughput.peak_tflops,
                   help="dense bf16 peak per GPU, TFLOP/s (H100 and H200 SXM: 989)")
    g.add_argument("--mfu", type=float, default=Throughput.mfu,
                   help="fraction of the peak training and prefill reach")
    g.add_argument("--hbm-util", type=float, default=Throughput.hbm_util,
                   help="fraction of --hbm-gbs a decode step reaches")
    g.add_argument("--prompt-len", type=int, default=None,
                   help="mean prompt tokens (default rollout.max_prompt_len: an upper bound)")
    g.add_argument("--response-len", type=int, default=None,
                   help="mean response tokens (default rollout.max_response_len: an upper bound)")
    g.add_argument("--gen-rounds", type=float, default=1.0, help="generation rounds per step")


def _bad_time_flags(args: argparse.Namespace) -> bool:
    lengths = [x for x in (args.prompt_len, args.response_len) if x is not None]
    return (args.peak_tflops <= 0 or not 0 < args.mfu <= 1 or not 0 < args.hbm_util <= 1
            or args.gen_rounds <= 0 or any(x < 1 for x in lengths))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_intermixed_args(argv)
    if (args.nodes < 1 or args.gpus_per_node < 1 or args.gpu_mem_gb <= 0 or args.reserve_gb < 0
            or not 0 < args.max_util <= 1 or min(args.nvlink_gbs, args.ib_gbs, args.hbm_gbs) <= 0
            or args.bucket_overhead_ms < 0):
        print("plan: --nodes and --gpus-per-node must be >= 1, --gpu-mem-gb > 0, --reserve-gb >= 0, "
              "--max-util in (0, 1], the bandwidths > 0, --bucket-overhead-ms >= 0", file=sys.stderr)
        return EXIT_BAD_INPUT
    if _bad_time_flags(args):
        print("plan: --peak-tflops and --gen-rounds must be > 0, --mfu and --hbm-util in (0, 1], "
              "--prompt-len and --response-len >= 1", file=sys.stderr)
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
    if is_disaggregated(cfg):
        return _disaggregated(args, cfg, spec, source, hw, links)
    plan = make_plan(cfg, spec, hw, model_source=source, config_name=args.config,
                     rollout_concurrency=args.rollout_concurrency, links=links)
    return _report(plan.to_dict(), format_plan(plan), plan.problems, args.json)


def _disaggregated(args: argparse.Namespace, cfg: Config, spec: ModelSpec, source: str, hw: Hardware,
                   links: Links) -> int:
    """rollout.colocate=false with SGLang: every split of the cluster planned and timed (plan/split.py)."""
    work, r = Workload.of(cfg, args.prompt_len, args.response_len, args.gen_rounds), cfg.rollout
    if work.prompt_tokens > r.max_prompt_len or work.response_tokens > r.max_response_len:
        print(f"plan: --prompt-len / --response-len are means: at most rollout.max_prompt_len="
              f"{r.max_prompt_len} / max_response_len={r.max_response_len}", file=sys.stderr)
        return EXIT_BAD_INPUT
    thr = Throughput(peak_tflops=args.peak_tflops, mfu=args.mfu, hbm_util=args.hbm_util)
    split = plan_disaggregated(cfg, spec, hw, work=work, throughput=thr, links=links, model_source=source,
                               config_name=args.config, rollout_concurrency=args.rollout_concurrency)
    return _report(split.to_dict(), format_disaggregated(split), split.problems, args.json)


def _report(data: dict[str, Any], text: str, problems: tuple[str, ...], as_json: bool) -> int:
    print(json.dumps(data, indent=2) if as_json else text)
    if not problems:
        return 0
    if as_json:
        print("plan: REFUSED:\n  - " + "\n  - ".join(problems), file=sys.stderr)
    return EXIT_REFUSED
