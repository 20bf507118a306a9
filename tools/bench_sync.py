"""Refit: one weight sync of a ~0.5B-parameter model into a real SGLang CPU server, per transport and dtype,
beside the copy limit measured in the same run.

The model: random weights of Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads / 2 KV heads, FFN 4864,
vocab 151936, tied embeddings: 494M parameters), from megatron_dapo.tiny's factory, written once per dtype.
One SGLang CPU server per dtype loads it (its venv: $MEGATRON_DAPO_SGLANG_VENV, see tools/sglang_venv.sh);
then each transport moves the whole model into it through the trainer's code path (SGLangEngine.update_weights
-> rollout/sglang/updates.py, the default bucket of each transport), timed end to end: serialisation, HTTP,
the server's load, the cache flush. The copy limit: one torch copy of the same bytes in this process
(`dst.copy_(src)`, pages touched beforehand), which any transport pays at least once; the tensor transport
pays two (into the shared bucket, then the server into its weights): its target is <= 2x the limit.
`bucket_overhead_ms`: the time of one bucket holding one small tensor, the per-bucket part of a refit
(what the planner's --bucket-overhead-ms assumes).

    python tools/bench_sync.py --json
    python tools/bench_sync.py --dtypes bfloat16 --transports tensor --layers 2 --repeats 1   # quicker
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from megatron_dapo.config import DEFAULT_BUCKET_MB, SGLangConfig
from megatron_dapo.parallel import free_port
from megatron_dapo.tiny import save_tiny_model

QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_attention_heads=14,
                  num_key_value_heads=2, max_position_embeddings=4096)
TRANSPORTS = ("tensor", "distributed", "disk")
DTYPES = ("float32", "bfloat16")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=24, help="transformer layers (Qwen2.5-0.5B: 24)")
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    p.add_argument("--transports", nargs="+", default=list(TRANSPORTS), choices=TRANSPORTS)
    p.add_argument("--repeats", type=int, default=2, help="refits per transport (the fastest is reported)")
    p.add_argument("--overhead-buckets", type=int, default=20,
                   help="one-tensor buckets timed for the per-bucket overhead")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    return p


def copy_limit(nbytes: int, repeats: int = 3) -> float:
    """Seconds of the fastest of `repeats` torch copies of `nbytes` between two touched buffers, on torch's
    threads and on one (on a busy machine the fastest of the two)."""
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    best, threads = float("inf"), torch.get_num_threads()
    for n in (threads, 1):
        torch.set_num_threads(n)
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t0)
    torch.set_num_threads(threads)
    return best


def refit(engine, weights: dict[str, torch.Tensor], transport: str) -> dict[str, float]:
    engine.bucket_bytes = DEFAULT_BUCKET_MB[transport] * 2**20
    t0 = time.perf_counter()
    engine.update_weights(weights.items(), transport=transport)
    seconds = time.perf_counter() - t0
    stats = engine.last_update
    return {"seconds": seconds, "bytes": stats.bytes, "buckets": stats.buckets, "tensors": stats.tensors}


def trainer_side_s(weights: dict[str, torch.Tensor]) -> float:
    """The tensor transport's part in this process: every bucket copied into the shared staging buffer and
    pickled (what a refit pays before and besides the server's load)."""
    from megatron_dapo.rollout.sglang.transport import flat_bucket, flat_payload
    from megatron_dapo.rollout.sglang.wire import iter_buckets

    staging: dict[str, torch.Tensor] = {}
    bucket_bytes = DEFAULT_BUCKET_MB["tensor"] * 2**20
    for _ in range(2):  # the first pass makes the staging buffer, as a run's first refit does
        t0 = time.perf_counter()
        for bucket in iter_buckets(weights.items(), bucket_bytes):
            flat_payload(*flat_bucket(bucket, staging, reserve=bucket_bytes))
    return time.perf_counter() - t0


def bucket_overhead_ms(engine, weights: dict[str, torch.Tensor], buckets: int) -> float:
    """One update of `buckets` buckets, each one small tensor (the final norm), per bucket."""
    name = "model.norm.weight"
    engine.bucket_bytes = 1
    t0 = time.perf_counter()
    engine.update_weights([(name, weights[name])] * buckets, transport="tensor")
    return (time.perf_counter() - t0) / buckets * 1e3


def checksum(engine) -> object:
    return engine.call("POST", "/weights_checker", {"action": "checksum"}, timeout=600)


def loaded_exactly(engine, moved: dict[str, torch.Tensor], started_with: object) -> bool:
    """After the refits the server holds `moved` (not what it started with): its checksum equals the one
    after loading `moved` from disk."""
    after_refits = checksum(engine)
    engine.update_weights(moved.items(), transport="disk")
    return after_refits == checksum(engine) != started_with


def run_dtype(dtype: str, args: argparse.Namespace, root: Path) -> list[dict]:
    from megatron_dapo.rollout.sglang.engine import SGLangEngine
    from megatron_dapo.rollout.sglang.server import default_python

    torch_dtype = getattr(torch, dtype)
    folder = save_tiny_model(root / dtype, "qwen2", seed=0, tied=True, dtype=torch_dtype,
                             num_hidden_layers=args.layers, **QWEN25_05B)
    from safetensors.torch import load_file

    weights = load_file(str(folder / "model.safetensors"))
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    params = sum(t.numel() for t in weights.values())
    t0 = time.perf_counter()
    engine = SGLangEngine(folder, SGLangConfig(startup_timeout_s=1200, request_timeout_s=1800),
                          python=default_python(), port=free_port(), dtype=dtype, device="cpu",
                          max_total_tokens=2048, log_dir=root / "logs")
    started = time.perf_counter() - t0
    rows = []
    moved = {n: -t for n, t in weights.items()}  # what the refits move: other weights than the server's
    try:
        started_with = checksum(engine)
        overhead = bucket_overhead_ms(engine, weights, args.overhead_buckets)
        limit = copy_limit(nbytes)
        for transport in args.transports:
            runs = [refit(engine, moved, transport) for _ in range(args.repeats)]
            best = min(runs, key=lambda r: r["seconds"])
            local = {"trainer_side_s": trainer_side_s(moved)} if transport == "tensor" else {}
            rows.append({"dtype": dtype, "transport": transport, "params": params, **best, **local,
                         "bytes_per_param": best["bytes"] / params,
                         "all_seconds": [r["seconds"] for r in runs],
                         "copy_limit_s": limit, "x_copy_limit": best["seconds"] / limit,
                         "GBps": best["bytes"] / best["seconds"] / 1e9, "server_start_s": started})
        same = loaded_exactly(engine, moved, started_with)
        for row in rows:
            row |= {"bucket_overhead_ms": overhead, "weights_checksum_equal": same}
    finally:
        engine.shutdown()
    return rows


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.manual_seed(0)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-sync-") as tmp:
        for dtype in args.dtypes:
            rows += run_dtype(dtype, args, Path(tmp))
    for row in rows:
        if args.json:
            print(json.dumps(row))
        else:
            print(f"{row['dtype']:9s} {row['transport']:12s} {row['params'] / 1e6:6.0f}M params "
                  f"{row['bytes'] / 1e9:5.2f} GB in {row['buckets']:3d} buckets: {row['seconds']:6.2f} s "
                  f"({row['GBps']:.2f} GB/s) = {row['x_copy_limit']:.2f} x the copy limit "
                  f"({row['copy_limit_s']:.3f} s); per bucket {row['bucket_overhead_ms']:.1f} ms")
    worst = max((r["x_copy_limit"] for r in rows if r["transport"] == "tensor"), default=None)
    if worst is not None:
        print(f"tensor transport: <= {worst:.2f} x the copy limit (target 2)", file=sys.stderr)
    print(f"median of all refits: {statistics.median(r['seconds'] for r in rows):.2f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
