"""CPU shims for the real SGLang runtime (used only inside the SGLang venv, only without CUDA).

`tools/sglang_venv.sh` copies two files from here into that venv's site-packages and adds a .pth line
that calls `megatron_dapo_sglang_cpu.install()` at interpreter start. Nothing here is imported by the
trainer; this package only names the files (SHIM_DIR) so the venv script and tests can find them.

- `megatron_dapo_sglang_cpu.py`: installs a lazy import hook. When SGLANG_USE_CPU_ENGINE=1 and CUDA is
  unavailable it (a) serves `import sgl_kernel` from the pure-torch stand-in (unless a real sgl_kernel
  is installed) and (b) makes a bare `torch.get_device_module()` return `torch.cpu` (with a CUDA build
  of torch 2.14 and no GPU it returns `torch.cuda`, whose synchronize() kills the scheduler on
  /release_memory_occupation), and (c) makes /release_memory_occupation lose the released regions'
  content (NaN) as CUDA's memory saver does: weights unless --enable-weights-cpu-backup, the KV cache always.
- `sgl_kernel_cpu_standin.py`: the two CPU ops SGLang's dense path calls, in plain torch.
"""

from pathlib import Path

SHIM_DIR = Path(__file__).resolve().parent
