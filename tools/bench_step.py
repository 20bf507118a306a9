"""What one DAPO step of a real-size model costs on this CPU: seconds per phase, trained tokens, and the
update's achieved FLOP/s against the practical peak of a torch matmul of the model's own shapes.

    python tools/bench_step.py --json                                     # SmolLM2-135M, 4 x 4 x 32, 2 steps
    python tools/bench_step.py --json --compare --prompts 16 --group-size 8 --max-response-len 48 --mini-batches 2
    python tools/bench_step.py --layers 2 --vocab 512 --prompts 2 --group-size 2 --max-response-len 8 --steps 1

The model is built here, randomly initialised (no hub): SmolLM2-135M's architecture (Llama, hidden 576,
MLP 1536, 30 layers, 9 heads / 3 KV heads, head 64, vocabulary 49152, tied embeddings, RoPE theta 1e5;
--layers / --vocab shrink it) with a byte-level BPE tokenizer and a ChatML chat template
(megatron_dapo.tiny.chat). The run is `python -m megatron_dapo.train` on the SmolLM2 recipe
(examples/configs/smollm2_135m_instruct.yaml) with built-in arithmetic prompts in the DAPO-Math
instruction, --mini-batches updates per step, no evaluation, dynamic sampling off (a random policy's groups
are all wrong, so the step would otherwise be only generation rounds); --set adds overrides. --compare runs
the same work twice, first as before issue 28 (the actor recomputes pi_old, computes every row's prompt, with
Megatron's unfused attention: BEFORE; its output layer computes the loss tokens only, as since 2026-12-04, so
BEFORE is faster than the code the issue measured), then as configured (AFTER), and reports step_ratio.
Per step, read from TensorBoard: timing/{rollout,reward,old_logprob,update,weight_sync,step}_s (rollout
includes reward, its scoring part), trained tokens = perf/tokens_per_s x timing/step_s (prompt + response
tokens of every trained row), update tokens = the positions the updates computed, padding left out
(perf/trained_tokens x (1 - perf/pad_frac), all updates: a shared prompt counts once), and
update_flop_per_s = 6 x (body x update tokens + head x output tokens) / update_s, where body is the weights
of every linear layer, head the (tied) output projection's and output tokens the positions it computed
(perf/output_tokens: the loss tokens, not the prompt), i.e. forward 2N + backward 4N FLOPs per token;
attention's score / value products (causal: 2 x 30 x 576 x S per token and pass at length S, about 2% at
S = 166, 3% at 260), norms, the embedding lookup and the loss are not counted. The peak is measured in the
same invocation, before and after the runs (the higher one counts: the machine may be shared), with the same
thread count: each of the model's matmul shapes, [T, in] @ [in, out] in fp32 with T = --peak-tokens (the
actor's micro-batch on CPU at a 49k vocabulary), timed best of 5, FLOPs summed over the model's layers /
total seconds. `ratio` = update_flop_per_s / peak_flop_per_s. `cores_used` = the trainer's CPU seconds / its
wall time (on a shared machine, how much of the CPU the run got). `summary` is the median over the steps
after the first (the first pays one-time start-up costs), or step 1 if only one ran.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = "examples/configs/smollm2_135m_instruct.yaml"
PHASES = ("rollout", "reward", "old_logprob", "update", "weight_sync", "step")
BEFORE = ("actor.shared_prefix=false", "algo.old_logprob_source=recompute", "model.local_attention=megatron")
AFTER = ("algo.old_logprob_source=auto",)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=4, help="prompts per step (train.prompt_batch_size)")
    p.add_argument("--group-size", type=int, default=4, help="responses per prompt (algo.group_size)")
    p.add_argument("--max-response-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--mini-batches", type=int, default=1, help="policy updates per step (prompts / mini-batch)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more config overrides of the run")
    p.add_argument("--compare", action="store_true", help="first run the work as before issue 28 (BEFORE)")
    p.add_argument("--layers", type=int, default=30, help="decoder layers (SmolLM2-135M: 30)")
    p.add_argument("--vocab", type=int, default=49152, help="model vocabulary (SmolLM2: 49152)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the trainer and of the peak matmul")
    p.add_argument("--peak-tokens", type=int, default=1024, help="rows of the peak matmuls (the actor's micro-batch)")
    p.add_argument("--keep", help="build the model in this folder and keep it and the run's files")
    p.add_argument("--json", action="store_true", help="one JSON object")
    return p


def model_config(layers: int, vocab: int) -> dict:
    from megatron_dapo.tiny.chat import SMOLLM2_135M

    return {**SMOLLM2_135M, "num_hidden_layers": layers, "vocab_size": vocab}


def matmul_shapes(cfg: dict) -> list[tuple[int, int, int]]:
    """(in, out, count) of every linear layer of the model, the output projection included."""
    h, kv = cfg["hidden_size"], cfg["num_key_value_heads"] * cfg["head_dim"]
    q, n = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_hidden_layers"]
    return [(h, q, n), (h, kv, 2 * n), (q, h, n), (h, cfg["intermediate_size"], 2 * n),
            (cfg["intermediate_size"], h, n), (h, cfg["vocab_size"], 1)]


def matmul_params(cfg: dict) -> int:
    return sum(i * o * c for i, o, c in matmul_shapes(cfg))


def peak_flop_per_s(cfg: dict, tokens: int, threads: int) -> float:
    """FLOPs of one forward of `tokens` tokens through the model's linear layers / the best time of the
    same matmuls (each shape timed on its own, best of 5, times its count)."""
    import torch

    torch.set_num_threads(threads)
    flops = seconds = 0.0
    for i, o, count in matmul_shapes(cfg):
        a, w = torch.randn(tokens, i), torch.randn(i, o)
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            torch.mm(a, w)
            best = min(best, time.perf_counter() - t0)
        flops += 2.0 * tokens * i * o * count
        seconds += best * count
    return flops / seconds


def build_model(path: Path, cfg: dict) -> int:
    """The random model and the chat tokenizer in `path`; returns its parameter count."""
    import torch

    from megatron_dapo.tiny.chat import save_smollm2_shaped

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    save_smollm2_shaped(path, layers=cfg["num_hidden_layers"], vocab=cfg["vocab_size"])
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:  # tied: the output shares the embedding
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118 (not iterable)


def train_command(args: argparse.Namespace, model: Path, root: Path, overrides: tuple[str, ...] = ()) -> list[str]:
    cache = max(1, args.max_response_len // 4)
    return ["-m", "megatron_dapo.train", "--config", RECIPE, f"model.hf_dir={model}",
            "data.train_path=builtin:arithmetic?n=256&seed=0&style=instruct", "data.val_path=null",
            f"train.steps={args.steps}", f"train.prompt_batch_size={args.prompts}",
            f"train.mini_batch_size={args.prompts // args.mini_batches}", f"algo.group_size={args.group_size}",
            "algo.dynamic_sampling=false", f"rollout.max_response_len={args.max_response_len}",
            f"reward.overlong_cache_len={cache}", "eval.every_steps=0", "checkpoint.save_every=0",
            "checkpoint.export_hf=false", "logging.samples_every=0", "rollout.weight_sync_probe=false",
            f"checkpoint.dir={root / 'ckpt'}", f"logging.tensorboard_dir={root / 'tb'}", "logging.run_name=bench",
            *overrides, *args.set]


def run_training(args: argparse.Namespace, model: Path, root: Path, overrides: tuple[str, ...]) -> tuple[dict, float, float]:
    from megatron_dapo.metrics import read_scalars

    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    t0, cpu0 = time.perf_counter(), _children_cpu()
    r = subprocess.run([sys.executable, *train_command(args, model, root, overrides)], cwd=REPO, env=env, check=False,
                       capture_output=True, text=True, timeout=7200)
    wall = time.perf_counter() - t0
    if r.returncode:
        raise RuntimeError(f"training failed (exit {r.returncode}):\n{r.stderr[-4000:]}")
    return read_scalars(root / "tb" / "bench"), wall, _children_cpu() - cpu0


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def step_rows(tb: dict, cfg: dict) -> list[dict]:
    """One row per step: each phase's seconds, trained tokens, the positions the updates computed, the
    update's FLOPs and FLOP/s."""
    rows, n, head = [], matmul_params(cfg), cfg["hidden_size"] * cfg["vocab_size"]
    for step in sorted(tb["timing/step_s"]):
        row = {"step": step, **{f"{p}_s": tb.get(f"timing/{p}_s", {}).get(step, 0.0) for p in PHASES}}
        row["trained_tokens"] = round(tb["perf/tokens_per_s"][step] * row["step_s"])
        computed = tb["perf/trained_tokens"][step]
        row["update_tokens"] = round(computed * (1.0 - tb["perf/pad_frac"][step]))
        row["pad_frac"] = tb["perf/pad_frac"][step]
        row["prefix_saved_frac"] = tb["perf/prefix_saved_frac"][step]
        row["output_tokens"] = round(tb["perf/output_tokens"][step])
        row["update_flops"] = 6.0 * ((n - head) * row["update_tokens"] + head * row["output_tokens"])
        row["update_flop_per_s"] = row["update_flops"] / row["update_s"] if row["update_s"] > 0 else 0.0
        rows.append(row)
    return rows


def summarise(rows: list[dict]) -> dict:
    later = rows[1:] or rows
    out = {k: statistics.median(r[k] for r in later) for k in rows[0] if k != "step"}
    out["steps_in_median"] = [r["step"] for r in later]
    return out


def measure(args: argparse.Namespace, cfg: dict, model: Path, root: Path, overrides: tuple[str, ...]) -> dict:
    """One training run: its rows, their median, its wall and CPU seconds."""
    root.mkdir(parents=True, exist_ok=True)
    tb, wall, cpu = run_training(args, model, root, overrides)
    rows = step_rows(tb, cfg)
    return {"overrides": [*overrides, *args.set], "train_wall_s": wall, "train_cpu_s": cpu,
            "cores_used": cpu / wall, "overhead_s": wall - sum(r["step_s"] for r in rows), "per_step": rows,
            "summary": summarise(rows),
            "command": " ".join(["python", *train_command(args, Path("<model>"), Path("<tmp>"), overrides)])}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.prompts % args.mini_batches:
        raise SystemExit(f"--mini-batches {args.mini_batches} does not divide --prompts {args.prompts}")
    cfg = model_config(args.layers, args.vocab)
    load_before = os.getloadavg()
    peak_before = peak_flop_per_s(cfg, args.peak_tokens, args.threads)
    with tempfile.TemporaryDirectory(prefix="bench_step_") as tmp:
        root = Path(args.keep) if args.keep else Path(tmp)
        model = root / "model"
        t0 = time.perf_counter()
        params = build_model(model, cfg)
        build_s = time.perf_counter() - t0
        before = measure(args, cfg, model, root / "before", BEFORE) if args.compare else None
        run = measure(args, cfg, model, root / "run", AFTER if args.compare else ())
    peaks = [peak_before, peak_flop_per_s(cfg, args.peak_tokens, args.threads)]
    peak = max(peaks)
    for r in (run, before):
        if r:  # the update against the machine's peak (the higher of its two measurements)
            r["summary"]["ratio"] = r["summary"]["update_flop_per_s"] / peak
    out = {"model": "SmolLM2-135M architecture (random weights)", "layers": args.layers, "vocab": args.vocab,
           "params": params, "matmul_params": matmul_params(cfg), "prompts": args.prompts,
           "group_size": args.group_size, "max_response_len": args.max_response_len, "steps": args.steps,
           "mini_batches": args.mini_batches, "threads": args.threads, "cpus": os.cpu_count(), "build_s": build_s,
           **run, "peak_tokens": args.peak_tokens, "peak_flop_per_s": peak, "peak_flop_per_s_before_after": peaks,
           "loadavg_before": list(load_before), "loadavg_after": list(os.getloadavg()),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if before:
        out["before"] = before
        out["step_ratio"] = run["summary"]["step_s"] / before["summary"]["step_s"]
    if args.json:
        print(json.dumps(out), flush=True)
        return 0
    print(f"{out['model']}: {args.layers} layers, {params / 1e6:.1f}M params; {args.prompts} prompts x "
          f"{args.group_size} x <= {args.max_response_len} tokens, {args.mini_batches} updates, {args.steps} steps, "
          f"{args.threads} threads (load {out['loadavg_before'][0]:.1f} -> {out['loadavg_after'][0]:.1f} on "
          f"{out['cpus']} cpus); matmul peak {peak / 1e9:.1f} GFLOP/s ({args.peak_tokens} rows)")
    for name, r in (("before", before), ("run", run)):
        if r:
            print_run(name, r)
    if before:
        print(f"step: x{out['step_ratio']:.2f} of before")
    return 0


def print_run(name: str, r: dict) -> None:
    s = r["summary"]
    print(f"{name} ({' '.join(r['overrides']) or 'as configured'}; the trainer used {r['cores_used']:.2f} cores):")
    for row in r["per_step"]:
        print(f"  step {row['step']}: " + ", ".join(f"{p} {row[p + '_s']:.1f} s" for p in PHASES)
              + f"; {row['trained_tokens']} trained tokens, {row['update_tokens']} computed by the updates; "
              f"update {row['update_flop_per_s'] / 1e9:.1f} GFLOP/s")
    print(f"  median: {s['step_s']:.1f} s/step, update {s['update_flop_per_s'] / 1e9:.1f} GFLOP/s = "
          f"{s['ratio']:.0%} of the peak; start-up and exit {r['overhead_s']:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
