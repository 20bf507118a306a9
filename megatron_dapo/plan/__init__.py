"""Dry-run planner: will this config fit on N nodes x G GPUs? No GPU needed.

    python -m megatron_dapo.plan --config examples/configs/dapo_qwen2.5_32b.yaml --nodes 16 --gpus-per-node 8
    python -m megatron_dapo.plan --config ... --nodes 1 --gpus-per-node 8 --gpu-mem-gb 141 --json

Prints the parallel layout (actor TP/PP/DP, SGLang engines), a per-GPU memory estimate for the two
phases of the colocated hybrid engine, tokens per step and updates per step, and REFUSES (exit 1,
every reason listed) a layout that does not divide or cannot fit. Exit 2: the config or model cannot
be read. The model's size comes from `--model-config` (a config.json or its folder), else
`model.hf_dir`/config.json, else the built-in table `KNOWN_MODELS` (matched by hf_dir's base name).
By default the planner reports how many worst-case sequences the SGLang KV pool holds; with
--rollout-concurrency N it checks that N worst-case sequences fit.
With rollout.colocate=false (SGLang) it splits the cluster into training and generation GPUs: every split
planned as above, the one with the least estimated step time chosen (pipelined with rollout.async_steps=1,
else synchronous), both step times and their ratio printed; refused when no split fits.

  core.py     the typed Plan (phases as named components with bytes per side: actor, engine)
  build.py    make_plan: fills the Plan, lists every problem
  memory.py   the per-GPU memory model (its docstring states every formula)
  models.py   resolve_model and the built-in KNOWN_MODELS table
  report.py   the text report;  cli.py / __main__.py  the command line
  split.py    plan_disaggregated: the splits of a disaggregated cluster, planned and timed
  cost.py     the step-time model of a split (its docstring states every formula)
  split_report.py  the split's text report
"""

from megatron_dapo.plan.build import make_plan
from megatron_dapo.plan.core import GIB, Hardware, PhaseMemory, Plan
from megatron_dapo.plan.cost import Throughput, Workload
from megatron_dapo.plan.models import KNOWN_MODELS, PlanInputError, resolve_model
from megatron_dapo.plan.split import Disaggregated, plan_disaggregated

__all__ = ["GIB", "KNOWN_MODELS", "Disaggregated", "Hardware", "PhaseMemory", "Plan", "PlanInputError",
           "Throughput", "Workload", "make_plan", "plan_disaggregated", "resolve_model"]
