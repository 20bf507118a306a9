#!/usr/bin/env bash
# Build (once, cached) the separate Python venv that runs the real SGLang server.
#
#   bash tools/sglang_venv.sh [VENV_DIR]   # default: $MEGATRON_DAPO_SGLANG_VENV or .venv-sglang in the repo
#
# SGLang 0.5.23 pins torch==2.14.1 (a CUDA build -- on local disk here -- that also runs on CPU) and
# many CUDA-only packages, so it cannot share the trainer's python (torch 2.13 CPU). We install torch +
# torchvision + triton, the runtime deps the server imports, then `sglang --no-deps` (no flashinfer,
# sglang-kernel, deep-gemm, ...). Our CPU shims (megatron_dapo/rollout/sglang/cpu_shims/) are copied
# into the venv and activated by a .pth file; they act only with SGLANG_USE_CPU_ENGINE=1 and no CUDA.
#
# Idempotent and cached: a stamp file holds the pinned spec; when it matches, only the shims are
# refreshed (well under a second). A cold build takes ~2-3 min and ~6.2 GB. Pip's output goes to
# VENV_DIR.build.log (shown on failure). The last line printed is the venv's python.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-${MEGATRON_DAPO_SGLANG_VENV:-$ROOT/.venv-sglang}}"
VENV="$(mkdir -p "$(dirname "$VENV")" && cd "$(dirname "$VENV")" && pwd)/$(basename "$VENV")"
PY_BASE="${SGLANG_VENV_BASE_PYTHON:-python3.11}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

TORCH_SPEC=(torch==2.14.1 torchvision==0.29.1 triton==3.8.0)
SGLANG_SPEC=(sglang==0.5.23)
RUNTIME_DEPS=(
  aiohttp fastapi "uvicorn>=0.51" uvloop pyzmq orjson msgspec pybase64 psutil requests
  transformers==5.19.0 tokenizers==0.23.2 sentencepiece==0.2.1 tiktoken pydantic python-multipart
  prometheus-client setproctitle packaging einops interegular partial_json_parser openai==2.8.0
  openai-harmony==0.0.4 tqdm regex scipy xxhash zstandard watchfiles distro "python-dateutil<3"
  IPython dill apache-tvm-ffi==0.1.11 compressed-tensors==0.18.0 gguf jsonschema xgrammar==0.2.7
  soundfile==0.13.1 safetensors numpy
)
STAMP_TEXT="v1 ${TORCH_SPEC[*]} | ${SGLANG_SPEC[*]} | ${RUNTIME_DEPS[*]}"
STAMP="$VENV/.megatron-dapo-sglang-stamp"
LOG="$VENV.build.log"

install_shims() {  # copy our CPU shims into site-packages; the .pth activates them lazily
  local site src="$ROOT/megatron_dapo/rollout/sglang/cpu_shims"
  site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  cp "$src/megatron_dapo_sglang_cpu.py" "$site/megatron_dapo_sglang_cpu.py"
  cp "$src/sgl_kernel_cpu_standin.py" "$site/megatron_dapo_sgl_kernel_cpu_standin.py"
  printf 'import megatron_dapo_sglang_cpu; megatron_dapo_sglang_cpu.install()\n' \
    > "$site/megatron_dapo_sglang_cpu.pth"
}

# One builder at a time for this venv path (parallel test sessions); the lock lives outside the repo.
exec 9>"${TMPDIR:-/tmp}/megatron-dapo-sglang-venv-$(printf '%s' "$VENV" | md5sum | cut -c1-12).lock"
flock 9

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$STAMP_TEXT" ] && [ -x "$VENV/bin/python" ]; then
  install_shims
  echo "$VENV/bin/python"
  exit 0
fi

if [ -e "$VENV" ] && [ ! -f "$VENV/pyvenv.cfg" ]; then
  echo "sglang_venv: $VENV exists and is not a venv; refusing to replace it" >&2
  exit 2
fi

start=$(date +%s)
echo "sglang_venv: building $VENV (torch 2.14.1 from local disk, sglang 0.5.23; log $LOG)" >&2
rm -rf "$VENV"
: > "$LOG"
pip_install() {
  if ! "$VENV/bin/python" -m pip install --no-input "$@" >>"$LOG" 2>&1; then
    echo "sglang_venv: pip install $* failed; last lines of $LOG:" >&2
    grep -v "is ignored: it is neither a file nor a directory" "$LOG" | tail -30 >&2
    exit 1
  fi
}
"$PY_BASE" -m venv "$VENV"
pip_install "${TORCH_SPEC[@]}"
pip_install "${TORCH_SPEC[@]}" "${RUNTIME_DEPS[@]}"  # torch pins repeated: nothing may move torch
pip_install --no-deps "${SGLANG_SPEC[@]}"
install_shims
# Smoke check: the server module imports with the shims active (as it will on a CPU machine).
if ! SGLANG_USE_CPU_ENGINE=1 "$VENV/bin/python" -W ignore -c 'import sglang.srt.entrypoints.http_server' \
    >>"$LOG" 2>&1; then
  echo "sglang_venv: the built venv cannot import sglang's server; last lines of $LOG:" >&2
  tail -30 "$LOG" >&2
  exit 1
fi
echo "$STAMP_TEXT" > "$STAMP"
echo "sglang_venv: built in $(( $(date +%s) - start )) s ($(du -sh "$VENV" | cut -f1))" >&2
echo "$VENV/bin/python"
