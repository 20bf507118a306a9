"""Wire formats between the trainer and an SGLang server: weight buckets, their serialisation for
/update_weights_from_tensor, the weight-update process group, and /generate payload parsing.

Pure helpers for `sglang_engine.SGLangEngine` (no server process handling here); see that module's
docstring for the three weight transports.
"""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from megatron_dapo.rollout.base import GenerationAborted
from megatron_dapo.types import FinishReason, Sample

_ALIGN = 64
"""Byte alignment of each tensor inside a flat bucket (any dtype can be viewed in place)."""


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a stream of tensors into buckets of at most `bucket_bytes` (consumed lazily, in order).

    A tensor larger than a bucket travels alone in its own bucket; no bucket is empty.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be > 0")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        n = tensor_nbytes(tensor)
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += n
    if bucket:
        yield bucket


def _aligned_layout(bucket: Sequence[tuple[str, torch.Tensor]]) -> tuple[list[int], int]:
    offsets, pos = [], 0
    for _, t in bucket:
        pos = -(-pos // _ALIGN) * _ALIGN
        offsets.append(pos)
        pos += tensor_nbytes(t)
    return offsets, pos


def _flat_views(
    flat: torch.Tensor, bucket: Sequence[tuple[str, torch.Tensor]], offsets: Sequence[int]
) -> list[tuple[str, torch.Tensor]]:
    """Copy each tensor into the flat uint8 buffer at its offset; return the (name, view) pairs."""
    views = []
    for (name, t), off in zip(bucket, offsets):
        view = flat[off : off + tensor_nbytes(t)].view(t.dtype).view(t.shape)
        view.copy_(t.detach())
        views.append((name, view))
    return views


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_generate_response(payload: Any, prompts: Sequence[Sequence[int]]) -> list[Sample]:
    """SGLang /generate JSON (one dict per request, in request order) -> Samples.

    Raises GenerationAborted if any request finished with type "abort", ValueError on a malformed
    payload (the message names the request index).
    """
    items = payload if isinstance(payload, list) else [payload]
    if len(items) != len(prompts):
        raise ValueError(f"/generate returned {len(items)} results for {len(prompts)} requests")
    samples = []
    for i, (item, prompt) in enumerate(zip(items, prompts)):
        meta = item.get("meta_info") or {}
        reason = (meta.get("finish_reason") or {}).get("type")
        if reason == "abort":
            raise GenerationAborted(f"request {i} was aborted: {meta.get('finish_reason')}")
        if reason not in ("stop", "length"):
            raise ValueError(f"request {i}: unexpected finish_reason {meta.get('finish_reason')!r}")
        out_ids = [int(t) for t in item["output_ids"]]
        lps = meta.get("output_token_logprobs")
        if lps is None or len(lps) != len(out_ids):
            raise ValueError(f"request {i}: {len(out_ids)} output ids but logprobs {lps!r:.200}")
        if any(int(tok) != t for (_, tok, *_), t in zip(lps, out_ids)):
            raise ValueError(f"request {i}: logprob token ids do not match output_ids")
        finish: FinishReason = reason
        samples.append(
            Sample(
                prompt_ids=list(prompt),
                response_ids=out_ids,
                rollout_logprobs=[float(lp) for lp, *_ in lps],
                finish_reason=finish,
            )
        )
    return samples


def _cut_at_stop(sample: Sample, stop: set[int]) -> Sample:
    """End a sample at its first stop token (kept, with its logprob) and mark it "stop"."""
    for i, tok in enumerate(sample.response_ids):
        if tok in stop:
            sample.response_ids = sample.response_ids[: i + 1]
            sample.rollout_logprobs = sample.rollout_logprobs[: i + 1]
            sample.finish_reason = "stop"
            break
    return sample


def checkpoint_shapes(model_path: str | Path) -> dict[str, tuple[int, ...]] | None:
    """Tensor names and shapes of an HF safetensors checkpoint (headers only); None if not readable."""
    from safetensors import safe_open

    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():  # noqa: SIM118 - safe_open is not a dict
                shapes[k] = tuple(st.get_slice(k).get_shape())
    cfg_file = Path(model_path) / "config.json"
    tied = cfg_file.exists() and json.loads(cfg_file.read_text()).get("tie_word_embeddings", False)
    if tied and "lm_head.weight" not in shapes and "model.embed_tokens.weight" in shapes:
        shapes["lm_head.weight"] = shapes["model.embed_tokens.weight"]
    return shapes


@contextmanager
def _file_system_sharing() -> Iterator[None]:
    import torch.multiprocessing as tmp

    old = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        tmp.set_sharing_strategy(old)


_SHM_MANAGER_STARTED = False


def _start_shm_manager_quietly() -> None:
    """Start torch's shm manager daemon with /dev/null as stdout/stderr.

    The file_system sharing strategy spawns `torch_shm_manager`, which inherits and keeps open this
    process's stdout/stderr; a parent that reads our output through a pipe would then wait for EOF
    as long as the SGLang server holds a segment. Spawning it once with /dev/null avoids that.
    """
    global _SHM_MANAGER_STARTED
    if _SHM_MANAGER_STARTED:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        with _file_system_sharing():
            torch.empty(1).share_memory_()
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, devnull):
            os.close(fd)
    _SHM_MANAGER_STARTED = True


def serialize_named_tensors(named: Sequence[tuple[str, torch.Tensor]]) -> str:
    """Pickle (name, tensor) pairs like sglang's MultiprocessingSerializer(output_str=True), without sglang.

    CPU tensors are (re)placed in shared memory and pickled by file name; CUDA tensors by IPC handle.
    The caller keeps the tensors alive until the server has loaded them.
    """
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers torch's reducers on ForkingPickler)

    if any(not t.is_cuda for _, t in named):
        _start_shm_manager_quietly()
    buf = io.BytesIO()
    with _file_system_sharing():
        ForkingPickler(buf).dump(list(named))
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _init_custom_process_group(
    backend: str, host: str, port: int, world_size: int, rank: int, group_name: str, timeout: timedelta
) -> Any:
    """A process group outside the default world (the same recipe SGLang uses on its side)."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    store, rank, world_size = next(rendezvous(f"tcp://{host}:{port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        PrefixStore(group_name, store),
        group_name=group_name,
        backend_options=None,
        timeout=timeout,
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def _parent_death_signal_setter() -> Any:
    """A preexec_fn asking the kernel to SIGTERM the server when the launching thread dies (Linux).

    libc is loaded here, in the parent: the function that runs between fork and exec imports nothing.
    """
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def set_pdeathsig() -> None:
        prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG

    return set_pdeathsig


def broadcast_payload(bucket: Sequence[tuple[str, torch.Tensor]], device: torch.device
                      ) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The /update_weights_from_distributed fields describing `bucket` and the tensors to broadcast.

    SGLang's flat receive buffer is dense (no padding): one broadcast of the whole bucket as uint8
    when every tensor starts aligned for its dtype there ("flattened_bucket"), else one per tensor.
    """
    meta: dict[str, Any] = {
        "names": [n for n, _ in bucket],
        "dtypes": [_dtype_name(t.dtype) for _, t in bucket],
        "shapes": [list(t.shape) for _, t in bucket],
    }
    pos, dense = 0, True
    for _, t in bucket:
        dense &= pos % t.element_size() == 0
        pos += tensor_nbytes(t)
    if dense:
        meta["load_format"] = "flattened_bucket"
        return meta, [torch.cat([t.detach().to(device).contiguous().view(-1).view(torch.uint8) for _, t in bucket])]
    return meta, [t.detach().to(device).contiguous() for _, t in bucket]


def alongside(calls: Sequence[Callable[[], Any]], local: Callable[[], Any]) -> Any:
    """Run the HTTP `calls` and `local()` at once (the sides of one collective) and return local's
    result. The first failure on any side is raised at once, not after the collective's timeout."""
    box: dict[Any, dict[str, Any]] = {}

    def run(key: Any, fn: Callable[[], Any]) -> None:
        try:
            box[key] = {"out": fn()}
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box[key] = {"error": e}

    jobs = [(k, fn) for k, fn in enumerate(calls)] + [("local", local)]
    for key, fn in jobs:
        threading.Thread(target=run, args=(key, fn), name=f"sglang-alongside-{key}", daemon=True).start()
    while True:
        for side in list(box.values()):
            if "error" in side:
                raise side["error"]
        if len(box) == len(jobs):
            return box["local"]["out"]
        time.sleep(0.002)

