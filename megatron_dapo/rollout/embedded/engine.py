"""In-process rollout engine on a transformers causal LM (the CPU default; also runs on one GPU).

All prompts x n samples of a call run as few, large batches: prompts are left-padded, each unique
prompt is prefilled once and its KV cache copied to its n sample rows, then one decode step per
token serves every row; rows that stop are dropped from the batch as they accumulate.

Two decoders (decoders.py) share that loop: a fast Llama-family one over the model's own weights
(about half of `model.generate`'s decode step on a small CPU model: the benchmark's speedup) and the
generic transformers forward for any other causal LM.

Sampling and logprob semantics are those of `base.py` (SGLang's default): the reported logprob is
log softmax(logits / T) of the sampled token, before top-p truncation (top-p keeps transformers'
TopPLogitsWarper's set: sampling.py). Sampling draws from a per-call torch.Generator, so a seed reproduces a call
exactly (for the same prompts, n and max_batch_tokens).

`stream()` is the streaming rollout (continuous.py): groups join a running batch as rows finish, and
come out as soon as their n samples are done.
"""

from __future__ import annotations

import difflib
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch import Tensor
from transformers import AutoModelForCausalLM, PreTrainedModel

from megatron_dapo.offload import HostOffload, device_bytes, own_storage
from megatron_dapo.rollout.base import (
    EngineStateError,
    GenerationAborted,
    RolloutEngine,
    RolloutStream,
    SamplingParams,
    check_prompts,
    check_tags,
)
from megatron_dapo.rollout.embedded.checkpoint_names import checkpoint_views
from megatron_dapo.rollout.embedded.continuous import EmbeddedStream
from megatron_dapo.rollout.embedded.decoders import Decoder, HFDecoder, LlamaDecoder, llama_fast_path_ok
from megatron_dapo.rollout.embedded.routes import read_routes
from megatron_dapo.rollout.embedded.sampling import sample_next
from megatron_dapo.rollout.embedded.slots import RowDecoder, SlotDecoder, WaveDecoder
from megatron_dapo.types import Sample

_COMPACT_BELOW = 0.75
"""Drop stopped rows from the batch once fewer than this fraction of its rows are still running."""


def _plan(lengths: Sequence[int], n: int, new_tokens: int, budget: int) -> list[list[tuple[int, int]]]:
    """(prompt, sample) rows in sub-batches of at most `budget` KV slots (at least one row each).

    Longest prompts first, so rows of similar length share a batch and padding stays small.
    """
    chunks: list[list[tuple[int, int]]] = []
    for p in sorted(range(len(lengths)), key=lambda p: -lengths[p]):
        for s in range(n):
            if chunks and (len(chunks[-1]) + 1) * (lengths[chunks[-1][0][0]] + new_tokens) <= budget:
                chunks[-1].append((p, s))
            else:
                chunks.append([(p, s)])
    return chunks


def _left_pad(prompts: Sequence[Sequence[int]], device: torch.device) -> tuple[Tensor, Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = True
    return ids.to(device), mask.to(device)


def _same_memory(a: Tensor, b: Tensor) -> bool:
    """b is a itself (same data, same layout): copying would be a no-op."""
    return a.data_ptr() == b.data_ptr() and a.stride() == b.stride() and a.dtype == b.dtype \
        and a.device == b.device


def _eos_ids(model: PreTrainedModel) -> set[int]:
    ids: set[int] = set()
    for source in (model.config, getattr(model, "generation_config", None)):
        eos = getattr(source, "eos_token_id", None)
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    return ids


class EmbeddedEngine(RolloutEngine):
    """Batched generation in this process; `model` is a transformers causal LM or an HF folder.

    The engine takes over the model: it moves it to `device`/`dtype` and puts it in eval mode.
    `max_batch_tokens` bounds the KV cache of one sub-batch: rows x (prompt + max_new_tokens).
    `fast_path`: None = the Llama-family decoder when the model supports it, else the generic one.
    `borrowed`: tensors whose memory another component owns (the actor's, when the model is built on its
    weights): the engine's parameters on that memory are neither released by sleep() nor counted as its own.
    `weights_backup`: sleep() keeps a host copy of the weights (SGLang's --enable-weights-cpu-backup); without
    it their content is lost (NaN when they come back), as CUDA's memory saver loses a paused region, so
    released weights must be synced again before generating.
    """

    def __init__(self, model: PreTrainedModel | str | Path, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, max_batch_tokens: int = 1 << 17,
                 fast_path: bool | None = None, borrowed: Iterable[Tensor] = (),
                 weights_backup: bool = False) -> None:
        if isinstance(model, (str, Path)):
            model = AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
        if max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens={max_batch_tokens} must be >= 1")
        if fast_path and not llama_fast_path_ok(model):
            raise ValueError(f"fast_path=True needs a dense Llama/Qwen2/Qwen3 model, "
                             f"got {model.config.model_type!r}")
        self.device = torch.device(device)
        self.model = model.to(device=self.device, dtype=dtype).eval()
        lent = {t.untyped_storage().data_ptr() for t in borrowed}
        # parameters on another component's memory (the actor's, shared_weights.py) stay with their owner
        self._own = [p for p in self.model.parameters() if p.untyped_storage().data_ptr() not in lent]
        own_storage(self._own)  # sleep() frees their memory in place
        self.max_batch_tokens = max_batch_tokens
        use_fast = llama_fast_path_ok(model) if fast_path is None else fast_path
        self._decoder_cls: type[LlamaDecoder] | type[HFDecoder] = LlamaDecoder if use_fast else HFDecoder
        self._params = checkpoint_views(dict(model.named_parameters(remove_duplicate=False)))
        self._eos = _eos_ids(model)
        self._busy = threading.Lock()
        self._abort = threading.Event()
        self._closed = False
        self._released: set[str] = set()  # memory tags released by sleep()
        self._offload = HostOffload()  # the weights while released
        self.weights_backup = weights_backup
        self._spare: RowDecoder | None = None  # a closed stream's decoder (its KV memory)

    # ---------------------------------------------------------------------------------- generate

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], n: int,
                 sampling: SamplingParams) -> list[list[Sample]]:
        check_prompts(prompt_token_ids, n)
        self._check_open()
        self._check_vocab(prompt_token_ids)
        stop = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else self._eos)
        stop_ids = torch.tensor(sorted(stop), dtype=torch.long, device=self.device)
        generator = torch.Generator(device=self.device)
        if sampling.seed is None:
            generator.seed()
        else:
            generator.manual_seed(sampling.seed)
        out: list[list[Sample]] = [[] for _ in prompt_token_ids]
        with self._busy, torch.inference_mode():
            self._check_ready()
            self._abort.clear()
            lengths = [len(p) for p in prompt_token_ids]
            for chunk in _plan(lengths, n, sampling.max_new_tokens, self.max_batch_tokens):
                samples = self._generate_chunk(prompt_token_ids, chunk, sampling, stop_ids, generator)
                for (p, _), sample in zip(chunk, samples):
                    out[p].append(sample)
        return out

    def _generate_chunk(self, prompts: Sequence[Sequence[int]], chunk: list[tuple[int, int]],
                        sampling: SamplingParams, stop_ids: Tensor,
                        generator: torch.Generator) -> list[Sample]:
        unique = list(dict.fromkeys(p for p, _ in chunk))
        ids, mask = _left_pad([prompts[p] for p in unique], self.device)
        decoder = self._decoder_cls(self.model, ids.shape[1] + sampling.max_new_tokens,
                                    record_routes=sampling.return_routes)
        logits = decoder.prefill(ids, mask)
        if len(unique) < len(chunk):  # copy each prompt's KV cache to its sample rows
            slot = {p: i for i, p in enumerate(unique)}
            rows = torch.tensor([slot[p] for p, _ in chunk], device=self.device)
            decoder.select(rows)
            logits = logits.index_select(0, rows)
        routes: list[Tensor | None] = [None] * len(chunk)
        tokens, logprobs, lengths, stopped = self._decode(decoder, logits, sampling, stop_ids, generator,
                                                          routes if sampling.return_routes else None)
        return [
            Sample(prompt_ids=list(prompts[p]), response_ids=tokens[r, : lengths[r]].tolist(),
                   rollout_logprobs=logprobs[r, : lengths[r]].tolist(),
                   finish_reason="stop" if stopped[r] else "length",
                   routes=read_routes(routes[r], len(prompts[p]) + int(lengths[r])))
            for r, (p, _) in enumerate(chunk)
        ]

    def _decode(self, decoder: Decoder, logits: Tensor, sampling: SamplingParams, stop_ids: Tensor,
                generator: torch.Generator, routes: list[Tensor | None] | None = None
                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Decode until every row stopped or max_new_tokens; rows keep their index in the outputs. `routes`: each
        output row's routes are stored there (a MoE model's) before its batch row is dropped."""
        num_rows, max_new = logits.shape[0], sampling.max_new_tokens
        tokens = torch.zeros(num_rows, max_new, dtype=torch.long, device=self.device)
        logprobs = torch.zeros(num_rows, max_new, dtype=torch.float32, device=self.device)
        lengths = torch.full((num_rows,), max_new, dtype=torch.long, device=self.device)
        stopped = torch.zeros(num_rows, dtype=torch.bool, device=self.device)
        rows = torch.arange(num_rows, device=self.device)  # output row of each batch row
        running = torch.ones(num_rows, dtype=torch.bool, device=self.device)
        for t in range(max_new):
            next_tokens, next_logprobs = sample_next(logits, sampling, generator)
            tokens[rows, t], logprobs[rows, t] = next_tokens, next_logprobs
            if stop_ids.numel():
                hit = running & torch.isin(next_tokens, stop_ids)
                lengths[rows[hit]], stopped[rows[hit]] = t + 1, True
                running &= ~hit
            num_running = int(running.sum())
            if num_running == 0 or t == max_new - 1:
                break
            if self._abort.is_set():
                raise GenerationAborted(f"aborted after {t + 1} tokens, {num_running} rows unfinished")
            if num_running < _COMPACT_BELOW * len(rows):
                keep = running.nonzero().squeeze(1)
                if routes is not None:
                    for i in (~running).nonzero().squeeze(1).tolist():
                        routes[int(rows[i])] = decoder.routes(i)
                decoder.select(keep)
                rows, running, next_tokens = rows[keep], running[keep], next_tokens[keep]
            logits = decoder.step(next_tokens)
        if routes is not None:
            for i, row in enumerate(rows.tolist()):
                routes[row] = decoder.routes(i)
        return tokens.cpu(), logprobs.cpu(), lengths.cpu(), stopped.cpu()

    def stream(self) -> RolloutStream:
        """Continuous batching within max_batch_tokens (continuous.py); several streams may be open. A
        closed stream's decoder (and its KV memory) serves the next one; sleep() releases it."""
        self._check_open()
        slots = SlotDecoder if self._decoder_cls is LlamaDecoder else WaveDecoder
        decoder, self._spare = self._spare or slots(self.model, self.max_batch_tokens), None
        return EmbeddedStream(decoder, eos=self._eos, vocab=self.model.get_output_embeddings().weight.shape[0],
                              device=self.device, engine_lock=self._busy, ready=self._check_ready,
                              check_prompts=self._check_vocab, on_close=self._keep_decoder)

    def _keep_decoder(self, decoder: RowDecoder) -> None:
        if not self._closed and "kv_cache" not in self._released:
            self._spare = decoder

    # ------------------------------------------------------------------------- weights and state

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        with self._busy, torch.no_grad():
            self._check_open()
            if "weights" in self._released:
                raise EngineStateError("EmbeddedEngine: its weights are released: wake() them before update_weights()")
            for name, tensor in named_tensors:
                param = self._params.get(name)
                if param is None:
                    near = difflib.get_close_matches(name, self._params, n=1)
                    hint = f" (did you mean {near[0]!r}?)" if near else ""
                    raise KeyError(f"update_weights: unknown parameter {name!r}{hint}")
                if tuple(tensor.shape) != tuple(param.shape):
                    raise ValueError(f"update_weights: {name}: got shape {tuple(tensor.shape)}, "
                                     f"the engine's parameter has {tuple(param.shape)}")
                if not _same_memory(param, tensor):  # a model built on the trainer's tensors
                    param.copy_(tensor)

    def sleep(self, tags: Sequence[str] | None = None) -> None:
        """"weights": their storage is freed (also on CPU), kept in a host copy only with weights_backup,
        the device's cache allocator is emptied; "kv_cache": nothing is held between calls to release."""
        with self._busy:
            self._check_open()
            release = set(check_tags(tags)) - self._released
            self._spare = None  # a kept stream decoder's KV cache
            if "weights" in release:
                self._offload.offload({"weights": self._own}, lose=() if self.weights_backup else ("weights",))
                if self.device.type != "cpu":
                    getattr(torch, self.device.type).empty_cache()
            self._released |= release

    def wake(self, tags: Sequence[str] | None = None) -> None:
        with self._busy:
            self._check_open()
            resume = set(check_tags(tags)) & self._released
            if "weights" in resume:
                self._offload.reload()
            self._released -= resume

    def score(self, token_ids: Sequence[int], start: int) -> list[list[float]]:
        if not 1 <= start < len(token_ids):
            raise ValueError(f"score: start={start} must be in [1, {len(token_ids)})")
        with self._busy, torch.no_grad():
            self._check_ready()
            self._check_vocab([token_ids])
            ids = torch.tensor([list(token_ids)], device=self.device)
            logp = self.model(ids).logits[0, start - 1:-1].float().log_softmax(-1)
            return [logp.gather(-1, ids[0, start:, None]).squeeze(-1).tolist()]

    def resident_bytes(self) -> dict[str, int]:
        """The weights' bytes on the device ("kv_cache": 0, it is allocated inside generate() only)."""
        if self._closed:
            return {"weights": 0, "kv_cache": 0}
        return {**device_bytes({"weights": self._own}, self.device), "kv_cache": 0}

    def abort(self) -> None:
        """Checked between decode steps: a running generate raises GenerationAborted; else no-op."""
        if self._busy.locked():
            self._abort.set()

    def health(self) -> bool:
        return not self._closed

    def shutdown(self) -> None:
        self.abort()
        with self._busy:
            self._closed = True
            self._spare = None
            self._params = {}
            self.model = None  # type: ignore[assignment]

    def _check_vocab(self, prompts: Sequence[Sequence[int]]) -> None:
        vocab = self.model.config.vocab_size
        for i, ids in enumerate(prompts):
            if min(ids) < 0 or max(ids) >= vocab:
                raise ValueError(f"prompt {i}: token ids must be in [0, {vocab}), "
                                 f"got min {min(ids)}, max {max(ids)}")

    def _check_open(self) -> None:
        if self._closed:
            raise EngineStateError("EmbeddedEngine was shut down")

    def _check_ready(self) -> None:
        self._check_open()
        if self._released:
            raise EngineStateError(f"EmbeddedEngine is asleep ({', '.join(sorted(self._released))} released): "
                                   "call wake() before generate()")

