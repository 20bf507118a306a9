"""One typed config tree for a DAPO run.

YAML files hold deltas over the defaults (schema.py); dotted CLI overrides (`algo.eps_high=0.28`) are
applied last (loading.py). Unknown keys and wrong types are errors that name the key. `validate()`
(validation.py) runs the cross-field checks before anything heavy is imported.

    python -m megatron_dapo.config --config examples/configs/tiny_cpu.yaml algo.eps_high=0.3 --print
"""

from __future__ import annotations

import argparse
import sys

from megatron_dapo.config.loading import (
    CliText, apply_delta, config_changes, load_config, parse_override, to_dict, to_yaml)
from megatron_dapo.config.schema import (
    ActorConfig,
    AlgoConfig,
    CheckpointConfig,
    Config,
    DEFAULT_BUCKET_MB,
    ConfigError,
    DataConfig,
    EvalConfig,
    FilterMetric,
    LoggingConfig,
    LossAggMode,
    ModelConfig,
    OnExhausted,
    OptimizerConfig,
    ParallelConfig,
    RewardConfig,
    RolloutConfig,
    SGLangConfig,
    TrainConfig,
    WandbConfig,
)
from megatron_dapo.config.validation import data_parallel_size, validate

__all__ = [
    "DEFAULT_BUCKET_MB", "ActorConfig", "AlgoConfig", "CheckpointConfig", "CliText", "Config", "ConfigError",
    "DataConfig", "EvalConfig",
    "FilterMetric", "LoggingConfig", "LossAggMode", "ModelConfig", "OnExhausted", "OptimizerConfig",
    "ParallelConfig", "RewardConfig", "RolloutConfig", "SGLangConfig", "TrainConfig", "WandbConfig",
    "apply_delta", "build_parser", "config_changes", "data_parallel_size", "load_config", "main", "parse_override", "to_dict", "to_yaml",
    "validate",
]


def build_parser(description: str = "Resolve and check a megatron-dapo config.") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", help="YAML file with deltas over the defaults")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algo.eps_high=0.28")
    parser.add_argument("--world-size", type=int, default=None, help="also check the parallel layout")
    parser.add_argument("--print", action="store_true", help="print the resolved config as YAML")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_intermixed_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        validate(cfg, args.world_size)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if args.print:
        print(to_yaml(cfg), end="")
    else:
        print(f"config OK: {args.config or '(defaults)'}")
    return 0
