"""Run by tests/test_kernels.py in a fresh process with TRITON_INTERPRET unset: compile every Triton
kernel variant ahead of time to a cubin for one CUDA arch (no GPU needed), one line per variant.

Triton fixes interpreter mode when triton.language is first imported, so the test process (which
runs the kernels in the CPU interpreter) cannot compile them for real; this process can.

    python tests/workers/triton_aot_compile.py ARCH      # e.g. 80, 90; exit 1 if any variant fails
"""

import os
import sys
import traceback
from typing import Any

from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile

from megatron_dapo.kernels import logprobs_triton as lt
from megatron_dapo.kernels import policy_loss_triton as pt


def aot_signature(kernel, logits_type: str) -> dict[str, str]:
    """A compile signature for `kernel` by argument naming convention (logits pointers in logits_type)."""

    def arg_type(name: str) -> str:
        if name in ("x_ptr", "out_ptr"):
            return logits_type
        if name.endswith("_ptr"):
            return {"tgt_ptr": "*i64", "clip_ptr": "*i8"}.get(name, "*fp32")
        if "stride_a" in name or "stride_b" in name:
            return "i64"
        return "fp32" if name.startswith(("eps", "clip_ratio")) or name == "inv_temp" else "i32"

    return {p.name: "constexpr" if p.is_constexpr else arg_type(p.name) for p in kernel.params}


def variants() -> list[tuple[Any, dict]]:
    out = [(lt._stats_kernel, {"BLOCK_V": 4096, "ENTROPY": e}) for e in (True, False)]
    flags = [(a, b) for a in (True, False) for b in (True, False)]
    out += [(lt._grad_kernel, {"BLOCK_V": 4096, "HAS_LP": a, "HAS_ENT": b}) for a, b in flags]
    return out + [(pt._clip_loss_kernel, {"BLOCK": pt.BLOCK})]


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("triton_aot_compile: run with TRITON_INTERPRET unset", file=sys.stderr)
        return 2
    target = GPUTarget("cuda", int(sys.argv[1]), 32)
    failed = 0
    for kernel, constexprs in variants():
        name = f"{kernel.fn.__name__}{sorted(constexprs.items())}"
        try:
            binary = compile(ASTSource(kernel, aot_signature(kernel, "*bf16"), constexprs), target=target)
            if not binary.asm.get("cubin"):
                raise RuntimeError("compiled to an empty cubin")
            print(f"ok {name} cubin={len(binary.asm['cubin'])} bytes", flush=True)
        except Exception:  # report every variant, then fail
            failed += 1
            print(f"FAILED {name}\n{traceback.format_exc()}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
