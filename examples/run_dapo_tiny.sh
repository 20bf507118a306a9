#!/usr/bin/env bash
# The embedded default: tiny DAPO on CPU. The trainer is not built yet, so for now this resolves,
# validates and prints the tiny config (the same file the trainer will take).
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=examples/configs/tiny_cpu.yaml
python -m megatron_dapo.config --config "$CONFIG" --world-size 1 --print "$@"
echo "[run_dapo_tiny] megatron_dapo.train does not exist yet: printed the resolved tiny config ($CONFIG) instead of training."
