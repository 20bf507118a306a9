"""Wire formats between the trainer and an SGLang server, as pure functions: weight buckets and their
flat aligned layout, the description of a broadcast bucket for /update_weights_from_distributed,
/generate payload parsing and stop-token cutting, and a checkpoint's tensor shapes.

No processes, sockets or shared memory here (transport.py moves the bytes); see engine.py's docstring
for the three weight transports.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from megatron_dapo.rollout.base import GenerationAborted, NonFiniteLogitsError, SamplingParams
from megatron_dapo.types import FinishReason, Sample, route_dtype

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


def aligned_layout(bucket: Sequence[tuple[str, torch.Tensor]]) -> tuple[list[int], int]:
    offsets, pos = [], 0
    for _, t in bucket:
        pos = -(-pos // _ALIGN) * _ALIGN
        offsets.append(pos)
        pos += tensor_nbytes(t)
    return offsets, pos


def flat_views(
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


def generate_body(prompts: Sequence[Sequence[int]], n: int, sampling: SamplingParams,
                  rids: Sequence[str] | None = None) -> tuple[dict[str, Any], list[list[int]], set[int]]:
    """The /generate body for n samples of each prompt (prompt-major; request k gets sampling_seed
    seed + k), the requests' prompts, and the stop ids to cut at client-side (SGLang's ignore_eos also
    ignores stop_token_ids; ours keeps them). `rids`: one request id per request (for /abort_request)."""
    # n copies of each prompt (SGLang's own `n` warms up each prompt sequentially).
    requests = [list(p) for p in prompts for _ in range(n)]
    params, cut_at = _sampling_params(sampling)
    sampling_params: Any = params
    if sampling.seed is not None:
        seeds = [(sampling.seed + k) % 2**63 for k in range(len(requests))]
        sampling_params = [dict(params, sampling_seed=seed) for seed in seeds]
    body: dict[str, Any] = {"input_ids": requests, "sampling_params": sampling_params, "return_logprob": True,
                            **_route_fields(sampling)}
    if rids is not None:
        if len(rids) != len(requests):
            raise ValueError(f"{len(rids)} rids for {len(requests)} requests")
        body["rid"] = list(rids)
    return body, requests, cut_at


def _sampling_params(sampling: SamplingParams) -> tuple[dict[str, Any], set[int]]:
    params: dict[str, Any] = {
        "max_new_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "ignore_eos": sampling.ignore_eos,
    }
    cut_at = set(sampling.stop_token_ids) if sampling.ignore_eos else set()
    if sampling.stop_token_ids and not cut_at:
        params["stop_token_ids"] = list(sampling.stop_token_ids)
    return params, cut_at


def continue_body(prompt: Sequence[int], samples: Sequence[tuple[int, Sample]], sampling: SamplingParams,
                  rids: Sequence[str]) -> tuple[dict[str, Any], set[int]]:
    """Partial rollout: the /generate body continuing sample k of a group from its response so far (input
    prompt + response, max_new_tokens less its length, sampling_seed seed + k), and the stop ids to cut at."""
    params, cut_at = _sampling_params(sampling)
    per_request = []
    for k, s in samples:
        p = dict(params, max_new_tokens=sampling.max_new_tokens - s.response_len)
        if sampling.seed is not None:
            p["sampling_seed"] = (sampling.seed + k) % 2**63
        per_request.append(p)
    inputs = [list(prompt) + list(s.response_ids) for _, s in samples]
    body = {"input_ids": inputs, "sampling_params": per_request, "return_logprob": True, "rid": list(rids),
            **_route_fields(sampling)}
    return body, cut_at


def _route_fields(sampling: SamplingParams) -> dict[str, Any]:
    """SGLang's routed-experts capture (needs a server started with ROUTES_FLAG): routes of every position from
    0 (routed_experts_start_len) to the sequence's end less one, the prompt's included."""
    return {"return_routed_experts": True, "routed_experts_start_len": 0} if sampling.return_routes else {}


ROUTES_FLAG = "--enable-return-routed-experts"


@dataclass(frozen=True)
class RouteShape:
    """A MoE model's routes per token: its MoE layers, each one's top-k, of how many experts."""

    layers: int
    top_k: int
    num_experts: int


def route_shape(hf_config: dict[str, Any]) -> RouteShape | None:
    """A MoE model's RouteShape from its config.json (every layer a MoE layer, as actor/model.py requires);
    None for a dense model."""
    experts = hf_config.get("num_experts") or hf_config.get("num_local_experts")
    if not experts:
        return None
    return RouteShape(layers=int(hf_config["num_hidden_layers"]), top_k=int(hf_config["num_experts_per_tok"]),
                      num_experts=int(experts))


def parse_routes(meta: dict[str, Any], request: int, tokens: int, shape: RouteShape) -> torch.Tensor:
    """meta_info["routed_experts"] (base64 of int32 [tokens, layers, top_k], SGLang's detokenizer's encoding) ->
    [tokens, layers, top_k] of Sample.routes' dtype. `tokens`: the positions the request read (prompt + output
    - 1)."""
    raw = meta.get("routed_experts")
    if not isinstance(raw, str):
        raise ValueError(f"request {request}: no routed_experts in the answer (a server started without "
                         f"{ROUTES_FLAG}?)")
    flat = torch.from_numpy(np.frombuffer(base64.b64decode(raw), dtype=np.int32).copy())
    per = shape.layers * shape.top_k
    if flat.numel() != tokens * per:
        raise ValueError(f"request {request}: {flat.numel()} routed experts for {tokens} positions x "
                         f"{shape.layers} layers x top-{shape.top_k}")
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= shape.num_experts):
        raise ValueError(f"request {request}: routed experts outside [0, {shape.num_experts})")
    return flat.view(tokens, shape.layers, shape.top_k).to(route_dtype(shape.num_experts))


def generated_tokens(payload: Any) -> int:
    """Tokens generated by every request of a /generate answer, aborted ones included."""
    items = payload if isinstance(payload, list) else [payload]
    return sum(len(item.get("output_ids") or []) for item in items)


def parse_generate_response(payload: Any, prompts: Sequence[Sequence[int]], aborted_ok: bool = False,
                            vocab_size: int | None = None, routes: RouteShape | None = None) -> list[Sample]:
    """SGLang /generate JSON (one dict per request, in request order) -> Samples.

    Raises GenerationAborted if any request finished with type "abort" (`aborted_ok`: such a request is a
    Sample with finish_reason "abort" and the tokens it has logprobs for), ValueError on a malformed
    payload (the message names the request index), NonFiniteLogitsError when a logprob is NaN/inf (SGLang's
    JSON writes them as null) or a token id lies outside [0, `vocab_size`): what a server samples from NaN
    logits. `routes`: the requests asked for their routed experts (Sample.routes; parse_routes; an aborted request
    has them where the server sent them).
    """
    items = payload if isinstance(payload, list) else [payload]
    if len(items) != len(prompts):
        raise ValueError(f"/generate returned {len(items)} results for {len(prompts)} requests")
    samples = []
    for i, (item, prompt) in enumerate(zip(items, prompts)):
        meta = item.get("meta_info") or {}
        reason = (meta.get("finish_reason") or {}).get("type")
        if reason == "abort" and not aborted_ok:
            raise GenerationAborted(f"request {i} was aborted: {meta.get('finish_reason')}")
        if reason not in ("stop", "length", "abort"):
            raise ValueError(f"request {i}: unexpected finish_reason {meta.get('finish_reason')!r}")
        out_ids = [int(t) for t in item.get("output_ids") or []]
        lps = meta.get("output_token_logprobs")
        if reason == "abort":  # keep the tokens that came with their logprobs
            lps = list(lps or [])[: len(out_ids)]
            out_ids = out_ids[: len(lps)]
        if lps is None or len(lps) != len(out_ids):
            raise ValueError(f"request {i}: {len(out_ids)} output ids but logprobs {lps!r:.200}")
        if any(int(tok) != t for (_, tok, *_), t in zip(lps, out_ids)):
            raise ValueError(f"request {i}: logprob token ids do not match output_ids")
        _check_finite(i, out_ids, [lp for lp, *_ in lps], vocab_size)
        finish: FinishReason = reason
        read = len(prompt) + len(out_ids) - 1
        samples.append(
            Sample(
                prompt_ids=list(prompt),
                response_ids=out_ids,
                rollout_logprobs=[float(lp) for lp, *_ in lps],
                finish_reason=finish,
                routes=None if routes is None or (reason == "abort" and "routed_experts" not in meta)
                else parse_routes(meta, i, read, routes),
            )
        )
    return samples


def _check_finite(request: int, ids: list[int], logprobs: list[Any], vocab_size: int | None) -> None:
    bad_lp = [lp for lp in logprobs if lp is None or not math.isfinite(float(lp))]
    bad_ids = [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
    if bad_lp or bad_ids:
        raise NonFiniteLogitsError(
            f"request {request}: the server's logits are not finite: {len(bad_lp)} of {len(ids)} logprobs "
            f"null/NaN/inf, {len(bad_ids)} token ids outside the vocabulary ({vocab_size}){bad_ids[:3]}")


def cut_at_stop(sample: Sample, stop: set[int]) -> Sample:
    """End a sample at its first stop token (kept, with its logprob) and mark it "stop"."""
    for i, tok in enumerate(sample.response_ids):
        if tok in stop:
            sample.response_ids = sample.response_ids[: i + 1]
            sample.rollout_logprobs = sample.rollout_logprobs[: i + 1]
            sample.finish_reason = "stop"
            if sample.routes is not None:
                sample.routes = sample.routes[: len(sample.prompt_ids) + i]
            break
    return sample


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
