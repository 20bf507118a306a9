"""Benchmark the DAPO loss: fused kernels vs naive torch vs Liger-Kernel (when installed).

Workload per case: N tokens -> per-token logprob of the target + entropy (a monitor, entropy_coef=0
as in DAPO) -> token-mean clipped loss -> gradients, forward + backward. Two families:

from logits [N, V] (gradient w.r.t. the logits); ratios against "naive":
    naive          log_softmax(logits.float()) + gather + entropy (no_grad), then algo.loss.policy_loss
    fused          kernels.fused_policy_loss (Triton on CUDA, chunked torch on CPU); new [N, V] gradient
    fused_inplace  the same with inplace_backward=True: the gradient overwrites the logits' storage
from hidden [N, H] and the lm-head weight [V, H] (gradients w.r.t. both; H = --hidden); ratios
against "naive_linear":
    naive_linear   logits = hidden @ weight^T, then naive
    fused_linear   kernels.fused_linear_policy_loss: token chunks, full logits never exist
    liger          liger_kernel LigerFusedLinearGRPOLoss(loss_type="dapo", beta=0), chunks of 512
                   tokens; no entropy. Skipped when liger_kernel does not import.

Each case runs in a fresh subprocess; peak memory is the extra over what is alive before the measured
call (inputs, incl. the logits), measured by megatron_dapo.benchmark (CUDA: max_memory_allocated; CPU:
VmHWM with glibc tuned to return freed memory). Times are wall-clock of the measured call (best of
--repeats), after --warmup calls. CPU times depend on the load: the table's header prints it.

    python tools/bench_loss.py                       # tokens {4k,16k} x vocab {32k,152k}
    python tools/bench_loss.py --tokens 1024 --vocab 8192 --json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from megatron_dapo.benchmark import PeakMemory, available_bytes, limit_address_space, load_text
from megatron_dapo.benchmark import run_case as run_fresh

IMPLS = ("naive", "fused", "fused_inplace", "naive_linear", "fused_linear", "liger")
BASELINE = {"fused": "naive", "fused_inplace": "naive", "fused_linear": "naive_linear", "liger": "naive_linear"}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def estimated_bytes(impl: str, tokens: int, vocab: int, dtype: str) -> int:
    """Rough peak (inputs included) to skip cases that cannot fit; measured numbers replace it."""
    elems = tokens * vocab
    naive = 20 + DTYPE_BYTES[dtype]  # measured: ~20 B/element over the logits, fp32 or bf16
    per_elem = {"naive": naive, "fused": 2 * DTYPE_BYTES[dtype], "fused_inplace": DTYPE_BYTES[dtype],
                "naive_linear": naive}
    return elems * per_elem.get(impl, 0) + (1 << 30)


def _make_step(impl: str, tokens: int, vocab: int, dtype, device: str, hidden: int):
    """Build inputs and return a closure running one forward + backward (and the logits bytes)."""
    import torch

    from megatron_dapo.algo.loss import policy_loss
    from megatron_dapo.kernels import fused_policy_loss
    from megatron_dapo.kernels.reference import reference_logprobs_and_entropy

    gen = torch.Generator(device=device).manual_seed(0)
    targets = torch.randint(0, vocab, (1, tokens), device=device, generator=gen)
    old = -torch.rand(1, tokens, device=device, generator=gen) * 5
    adv = torch.tensor([1.0], device=device)
    mask = torch.ones(1, tokens, device=device)
    kw: dict[str, Any] = {"eps_low": 0.2, "eps_high": 0.28}
    if impl in ("naive_linear", "fused_linear", "liger"):
        return _linear_step(impl, targets, old, mask, vocab, dtype, device, hidden, gen), 0
    logits = (torch.randn(1, tokens, vocab, device=device, generator=gen) * 3).to(dtype).requires_grad_()

    def step() -> None:
        x = logits.view_as(logits)  # a non-leaf, as logits coming out of the output layer
        if impl == "naive":
            lp, _ = reference_logprobs_and_entropy(x, targets)
            with torch.no_grad():
                reference_logprobs_and_entropy(x, targets)  # entropy as a monitor, as trainers log it
            loss, _ = policy_loss(lp, old, adv, mask, agg_mode="token-mean", global_num_tokens=tokens, **kw)
        else:
            loss, _ = fused_policy_loss(x, targets, old, adv, mask, global_num_tokens=tokens,
                                        inplace_backward=impl == "fused_inplace", **kw)
        torch.autograd.grad(loss, logits)

    return step, logits.numel() * logits.element_size()


def _linear_step(impl: str, targets, old, mask, vocab: int, dtype, device: str, hidden: int, gen):
    import torch

    from megatron_dapo.algo.loss import policy_loss
    from megatron_dapo.kernels import fused_linear_policy_loss
    from megatron_dapo.kernels.reference import reference_logprobs_and_entropy

    tokens = targets.shape[1]
    seq = 512 if tokens % 512 == 0 else tokens
    h = (torch.randn(tokens // seq, seq, hidden, device=device, generator=gen) * hidden**-0.5).to(dtype)
    h.requires_grad_()
    w = (torch.randn(vocab, hidden, device=device, generator=gen) * 3).to(dtype).requires_grad_()
    targets, old, mask = (t.view(-1, seq) for t in (targets, old, mask))
    adv = torch.ones(tokens // seq, device=device)
    kw: dict[str, Any] = {"eps_low": 0.2, "eps_high": 0.28}
    if impl == "liger":
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        liger = LigerFusedLinearGRPOLoss(beta=0.0, compiled=False, use_ref_model=False, epsilon_low=0.2,
                                         epsilon_high=0.28, loss_type="dapo")

        def step() -> None:
            out = liger(h, w, targets, mask, adv, old_per_token_logps=old)
            torch.autograd.grad(out[0] if isinstance(out, tuple) else out, (h, w))

    elif impl == "fused_linear":

        def step() -> None:
            loss, _ = fused_linear_policy_loss(h, w, targets, old, adv, mask, global_num_tokens=tokens, **kw)
            torch.autograd.grad(loss, (h, w))

    else:

        def step() -> None:
            logits = h @ w.T
            lp, _ = reference_logprobs_and_entropy(logits, targets)
            with torch.no_grad():
                reference_logprobs_and_entropy(logits, targets)
            loss, _ = policy_loss(lp, old, adv, mask, agg_mode="token-mean", global_num_tokens=tokens, **kw)
            torch.autograd.grad(loss, (h, w))

    return step


def run_case(args: argparse.Namespace) -> dict:
    """Inside the per-case subprocess: measure one (impl, tokens, vocab)."""
    import gc

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    limit_address_space(args.rlimit_bytes)
    step, logits_bytes = _make_step(args.impl[0], args.tokens[0], args.vocab[0], getattr(torch, args.dtype),
                                    args.device, args.hidden)
    for _ in range(args.warmup):
        step()
    gc.collect()
    times = []
    with PeakMemory(args.device) as mem:
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            step()
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    return {"impl": args.impl[0], "device": args.device, "tokens": args.tokens[0], "vocab": args.vocab[0],
            "fwd_bwd_s": round(min(times), 4), "peak_bytes": int(mem.peak), "dtype": args.dtype,
            "logits_bytes": logits_bytes}  # fmt: skip


def spawn_case(args: argparse.Namespace, impl: str, tokens: int, vocab: int) -> dict | None:
    cmd = [__file__, "--_case", "--impl", impl, "--tokens", str(tokens), "--vocab", str(vocab)]
    for flag in ("dtype", "device", "hidden", "repeats", "warmup", "threads"):
        cmd += [f"--{flag}", str(getattr(args, flag))]
    if args.device == "cpu":
        cmd += ["--rlimit-bytes", str(int(args.limit_bytes) + (4 << 30))]  # + address space that is not data
    return run_fresh(cmd, timeout=args.timeout, label=f"{impl} tokens={tokens} vocab={vocab}")


def liger_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("liger_kernel") is not None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--vocab", type=int, nargs="+", default=[32768, 152064])
    p.add_argument("--impl", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES))
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--hidden", type=int, default=256, help="hidden size H of the linear family")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument(
        "--max-gib",
        type=float,
        default=None,
        help="skip cases estimated above (default: 70%% of MemAvailable)",
    )
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    p.add_argument("--_case", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rlimit-bytes", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args._case:
        print(json.dumps(run_case(args)))
        return
    impls = [i for i in IMPLS if i in args.impl and (i != "liger" or liger_available())]  # baselines first
    limit = args.limit_bytes = (args.max_gib * 2**30) if args.max_gib else 0.7 * available_bytes()
    if not args.json:
        threads = f"{args.threads} torch threads, " if args.threads else ""
        print(f"# {args.device} {args.dtype}, {threads}{load_text()}; "
              "ratios: fused* vs naive, fused_linear/liger vs naive_linear", flush=True)  # fmt: skip
    rows = []
    for tokens in args.tokens:
        for vocab in args.vocab:
            done: dict[str, dict] = {}
            for impl in impls:
                if args.device == "cpu" and estimated_bytes(impl, tokens, vocab, args.dtype) > limit:
                    print(
                        f"# skip {impl} tokens={tokens} vocab={vocab}: estimate > {limit / 2**30:.1f} GiB",
                        file=sys.stderr,
                    )
                    continue
                row = spawn_case(args, impl, tokens, vocab)
                if row is None:
                    continue
                done[impl] = row
                base = done.get(BASELINE.get(impl, ""))
                if base is not None:
                    row["time_vs_naive"] = round(row["fwd_bwd_s"] / base["fwd_bwd_s"], 3)
                    row["peak_vs_naive"] = round(row["peak_bytes"] / max(base["peak_bytes"], 1), 4)
                rows.append(row)
                print(json.dumps(row) if args.json else _format(row), flush=True)


def _format(row: dict) -> str:
    case = f"{row['impl']:>14} {row['device']:>5} {row['dtype']:>9} N={row['tokens']:>6} V={row['vocab']:>6}"
    peak = f"peak {row['peak_bytes'] / 2**20:9.1f} MiB  (logits {row['logits_bytes'] / 2**20:.0f} MiB)"
    ratios = (
        f"  time x{row['time_vs_naive']:.2f}  peak x{row['peak_vs_naive']:.3f}"
        if "time_vs_naive" in row
        else ""
    )
    return f"{case}  {row['fwd_bwd_s']:8.3f} s  {peak}{ratios}"


if __name__ == "__main__":
    main()
