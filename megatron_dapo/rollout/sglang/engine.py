"""SGLang rollout engine: one `sglang.launch_server` process, driven over its HTTP API.

The server runs from its own python (`python=`; on CPU the venv that `tools/sglang_venv.sh` builds,
torch 2.14.1 + sglang 0.5.23), bound to 127.0.0.1, with `--skip-tokenizer-init` (token ids in and
out). This module imports neither sglang nor anything outside the standard library, torch and
safetensors, so the trainer's python (torch 2.13, no sglang) drives it.

Without CUDA the server is SGLang's CPU engine (`SGLANG_USE_CPU_ENGINE=1 --device cpu
--attention-backend torch_native`, cuda graphs off); the two CPU shims of
`megatron_dapo/rollout/sglang/cpu_shims/` are active there. With CUDA the normal flags apply, plus
`--enable-memory-saver` when colocated so that sleep()/wake() really free and retake GPU memory.

Weight transports (`SGLangConfig.weight_sync`; the steps of an update in updates.py, the moving parts
in transport.py). All three were verified against the real SGLang 0.5.23 server on CPU from a torch 2.13
trainer process without sglang; logprobs after a sync equal the source model's within 1e-4
(tests/test_rollout_sglang.py):
- "tensor" (colocated): each bucket is copied once into a flat buffer and pickled once per server TP
  rank for load_format "flattened_bucket" (the flat tensor + SimpleNamespace metadata SGLang's
  restricted unpickler admits) with torch's ForkingPickler -- what sglang's MultiprocessingSerializer
  does -- then POSTed to /update_weights_from_tensor (base64). CPU tensors travel as shared-memory file
  names (file_system sharing strategy, set only around the pickling); CUDA tensors as CUDA IPC handles
  naming their device by UUID (runs only in the gpu tier). In a job, each colocated trainer rank
  serialises the payload of the server rank on its own GPU (updates.NodeWeightSync).
- "distributed" (disaggregated): a dedicated process group (rank 0 = this process, ranks 1.. = the
  server's TP workers; gloo on CPU, NCCL on GPU) made with /init_weights_update_group; each bucket is
  one broadcast of a flat uint8 tensor (load_format "flattened_bucket"), announced by
  /update_weights_from_distributed. torch 2.13 (trainer) <-> 2.14 (server) gloo interoperates.
- "disk": buckets are written as safetensors shards into a temporary folder, loaded with one
  /update_weights_from_disk, then deleted. Needs a file system both processes see.
Tensor and distributed updates are wrapped in /begin_weight_update ... /end_weight_update (SGLang
0.5.x refuses them otherwise); every update ends with /flush_cache (no stale radix-cache KV).

Failure handling (server.py, the process and HTTP layer under the engine): every HTTP call has
a timeout and runs while the server's process tree is watched; a server that exits, or does not
answer in time, raises `SGLangServerError` naming the address, the PID and the log file, with the
log's last lines. Nothing here waits without a bound.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from megatron_dapo.config import DEFAULT_BUCKET_MB, SGLangConfig
from megatron_dapo.config.model_checks import read_model_config
from megatron_dapo.hf_files import checkpoint_shapes
from megatron_dapo.rollout.base import (
    EngineStateError,
    GenerationAborted,
    RolloutEngine,
    RolloutStream,
    SamplingParams,
    check_prompts,
    check_tags,
)
from megatron_dapo.rollout.sglang.server import SGLangServer, SGLangServerError
from megatron_dapo.rollout.sglang.stream import SGLangStream
from megatron_dapo.rollout.sglang.transport import WeightBroadcastGroup
from megatron_dapo.rollout.sglang.updates import NodeSyncCounts, NodeWeightSync
from megatron_dapo.rollout.sglang.wire import (
    RouteShape,
    cut_at_stop,
    generate_body,
    parse_generate_response,
    route_shape,
)
from megatron_dapo.types import Sample


@dataclass
class WeightUpdateStats:
    seconds: float = 0.0
    bytes: int = 0
    tensors: int = 0
    buckets: int = 0
    transport: str = ""


# ------------------------------------------------------------------------------------------ engine


class SGLangEngine(SGLangServer, RolloutEngine):
    """One SGLang server (one rollout TP group) as a `RolloutEngine`.

    `model_path`: HF folder the server loads at start (and whose safetensors headers are used to
    check names/shapes of weight updates). `cfg`: the SGLang sub-config. `bucket_mb`: weight-sync
    bucket size (RolloutConfig.weight_sync_bucket_mb). `python`: the interpreter with sglang
    (default: see `server.default_python`). `port`: default cfg.base_port + server_index; on CUDA, server k
    uses GPUs k*TP .. k*TP+TP-1 (--base-gpu-id). `dtype`: the
    server's --dtype. `device`: "auto" = cuda if this process sees CUDA, else the CPU engine.
    `log_dir`: where `sglang-<host>-<port>.log` goes. `extra_args`: more launch flags (after
    cfg.extra_args). Starting waits for /health up to cfg.startup_timeout_s.

    The server gets its own process group (shutdown() stops the whole tree: SIGINT, then SIGKILL
    after `shutdown_grace_s`), blocks SIGTERM and SIGUSR1 (the trainer's preemption signals, which Slurm
    sends to every process of the job), is stopped at interpreter exit, and with `kill_with_parent` gets
    SIGINT from the kernel if the thread that created the engine dies, and its group SIGKILL from a
    watchdog a few seconds after this process is gone (so a killed trainer leaves no server behind, hung or
    not; create engines in a long-lived thread, or pass False). With `wait=False` the
    constructor only starts the process; call `wait_ready()` before using it; a stop signal (any
    exception) while it waits kills the server at once.

    `attach=True` drives a server that another process started (e.g. another node's leader rank) at
    host:port: nothing is launched or killed here, and a dead server shows as failing HTTP calls.
    `trainer_host`: the address this process listens on for the "distributed" weight transport
    (default `host`; a remote server must be able to reach it).

    `seed` in SamplingParams is passed as SGLang's per-request `sampling_seed` (sample k of a call
    gets seed + k); SGLang honours it only with `--enable-deterministic-inference`.
    """

    def __init__(
        self,
        model_path: str | Path,
        cfg: SGLangConfig | None = None,
        *,
        bucket_mb: int = 0,
        trainer_host: str | None = None,
        **server: Any,
    ) -> None:
        cfg = cfg or SGLangConfig()
        self.bucket_bytes = int((bucket_mb or DEFAULT_BUCKET_MB[cfg.weight_sync]) * 2**20)
        self._shapes = checkpoint_shapes(str(model_path))
        hf_config = read_model_config(str(model_path)) or {}
        vocab = hf_config.get("vocab_size")
        self.vocab_size = vocab if isinstance(vocab, int) else None  # sampled ids beyond it: NaN logits
        self.route_shape = route_shape(hf_config)
        self._released: set[str] = set()  # memory tags released (see sleep)
        self._tags_ok = True  # the server takes memory tags (SGLang >= 0.4.6); else whole release only
        self._memory_sizes: dict[str, int] | None = None
        self._abort = threading.Event()
        self._updaters: dict[str, NodeWeightSync] = {}
        self._versions = itertools.count(1)
        self.weight_groups: list[WeightBroadcastGroup] = []
        """The broadcast groups this server is in (left at shutdown)."""
        self.last_update = WeightUpdateStats()
        self.stale_weights = False
        """Restarted since the last weight update: it holds the checkpoint's weights, not the current ones."""
        self.trainer_host = trainer_host or server.get("host", "127.0.0.1")
        super().__init__(model_path, cfg, **server)
        self._weight_group = WeightBroadcastGroup([self], self.trainer_host)
        self.weight_groups.append(self._weight_group)

    def restart(self) -> None:
        """As SGLangServer.restart; the server comes back awake, holding the checkpoint's weights (`stale_weights`
        until the next update_weights), and out of the weight-broadcast groups it was in."""
        self._released, self._memory_sizes, self.stale_weights = set(), None, True
        super().restart()
        for group in self.weight_groups:  # rejoined (under a new name) by the next update
            group.destroy()

    def shutdown(self) -> None:
        if self._closed:
            return
        for group in self.weight_groups:
            group.destroy()
        super().shutdown()

    # -------------------------------------------------------------------------------- generate

    def generate(
        self, prompt_token_ids: Sequence[Sequence[int]], n: int, sampling: SamplingParams
    ) -> list[list[Sample]]:
        check_prompts(prompt_token_ids, n)
        if self._released:
            raise EngineStateError(f"SGLang engine {self.url} is asleep: call wake() before generate()")
        if not prompt_token_ids:
            return []
        body, requests, cut_at = generate_body(prompt_token_ids, n, sampling)
        self._abort.clear()
        payload = self.post("/generate", body)
        if self._abort.is_set():
            raise GenerationAborted(f"generate on {self.url} was aborted")
        samples = parse_generate_response(payload, requests, vocab_size=self.vocab_size,
                                          routes=self.routes_of(sampling))
        if cut_at:
            samples = [cut_at_stop(s, cut_at) for s in samples]
        return [samples[i * n : (i + 1) * n] for i in range(len(prompt_token_ids))]

    def routes_of(self, sampling: SamplingParams) -> RouteShape | None:
        """The routes' shape when `sampling` asks for them (None: not asked, or a dense model: no routes)."""
        return self.route_shape if sampling.return_routes else None

    def stream(self, concurrency: int = 256) -> RolloutStream:
        """Concurrent per-group /generate calls, at most `concurrency` at once (stream.py)."""
        if self.asleep:
            raise EngineStateError(f"SGLang engine {self.url} is asleep: call wake() before stream()")
        return SGLangStream(self, concurrency)

    def score(self, token_ids: Sequence[int], start: int) -> list[list[float]]:
        """/generate with the sequence as the prompt and its input logprobs (greedy: SGLang reports them at
        temperature 1). SGLang gives the first position of its logprob window none: the window opens one early."""
        if self._released:
            raise EngineStateError(f"SGLang engine {self.url} is asleep: call wake() before score()")
        if not 1 <= start < len(token_ids):
            raise ValueError(f"score: start={start} must be in [1, {len(token_ids)})")
        body = {"input_ids": list(token_ids), "return_logprob": True, "logprob_start_len": start - 1,
                "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
        entries = self.post("/generate", body)["meta_info"]["input_token_logprobs"][-(len(token_ids) - start):]
        return [[math.nan if e[0] is None else float(e[0]) for e in entries]]

    def abort(self) -> None:
        self._abort.set()
        self.post("/abort_request", {"abort_all": True}, timeout=60)

    def health(self) -> bool:
        if self._closed or self.dead_reason() is not None:
            return False
        try:
            status, _ = self._http("GET", "/health", None, timeout=10)
        except Exception:
            return False
        return status == 200

    @property
    def asleep(self) -> bool:
        return bool(self._released)

    @property
    def weights_released(self) -> bool:
        return "weights" in self._released

    # SGLang's own memory types; a whole release ({} = no tags) frees all of them, the CUDA graphs too
    SERVER_MEMORY_TYPES = ("weights", "kv_cache", "cuda_graph")

    def sleep(self, tags: Sequence[str] | None = None) -> None:
        """/release_memory_occupation: everything (tags=None), or only the tagged regions; once the server is
        idle (`wait_idle`)."""
        new = set(check_tags(tags)) - self._released
        if not new:
            return
        self.wait_idle()
        if tags is None or not self._tags_ok:
            self.post("/release_memory_occupation", {}, timeout=600)
            self._released = set(self.SERVER_MEMORY_TYPES)
            return
        self.post("/release_memory_occupation", {"tags": sorted(new)}, timeout=600)
        self._released |= new

    IDLE_WAIT_S = 300.0
    """How long `wait_idle` waits for the server to drain before it refuses to release its memory."""
    IDLE_POLL_S = 0.1
    REABORT_S = 5.0

    def wait_idle(self, timeout_s: float | None = None) -> None:
        """Until two load reports in a row (/v1/loads) show no request running or waiting. SGLang's handler of
        /release_memory_occupation asserts that the scheduler is fully idle, and the failed assertion kills the
        scheduler (sglang 0.5.23 managers/scheduler_components/weight_updater.py); a stream's abort() stops
        waiting for its aborted calls after a bound, so some may still run when the trainer releases. Those get
        /abort_request again every REABORT_S seconds. A server without the report (older SGLang) is not waited for."""
        timeout_s = self.IDLE_WAIT_S if timeout_s is None else timeout_s
        start = time.monotonic()
        idle_reports, next_abort = 0, start + self.REABORT_S
        while True:
            busy = self._busy_requests()
            idle_reports = idle_reports + 1 if not busy else 0
            if busy is None or idle_reports == 2:
                return
            now = time.monotonic()
            if now - start > timeout_s:
                raise EngineStateError(f"SGLang engine {self.url} still has {busy} request(s) {timeout_s:g} s after "
                                       "the trainer asked it to sleep: its memory is not released (SGLang's "
                                       "scheduler dies on a release while it serves)")
            if busy and now >= next_abort:
                self.post("/abort_request", {"abort_all": True}, timeout=60)
                next_abort = now + self.REABORT_S
            time.sleep(self.IDLE_POLL_S)

    def _busy_requests(self) -> int | None:
        """Requests running or waiting on the server's schedulers (/v1/loads); None without that report."""
        try:
            loads = self.call("GET", "/v1/loads?include=core", None, timeout=60)["loads"]
            return sum(int(x.get("num_running_reqs", 0)) + int(x.get("num_waiting_reqs", 0)) for x in loads)
        except SGLangServerError:
            if self.dead_reason() is not None:
                raise
            return None
        except (KeyError, TypeError, ValueError, AttributeError):
            return None

    def wake(self, tags: Sequence[str] | None = None) -> None:
        """/resume_memory_occupation of `tags` (None: everything still released). A server that refuses
        tags gets one whole resume instead (the old, weights-and-KV-together protocol)."""
        todo = (set(self._released) if tags is None else set(check_tags(tags))) & self._released
        if not todo:
            return
        if self._tags_ok and todo != set(self.SERVER_MEMORY_TYPES):
            try:
                self.post("/resume_memory_occupation", {"tags": sorted(todo)}, timeout=600)
                self._released -= todo
                return
            except SGLangServerError:
                if self.dead_reason() is not None:
                    raise
                self._tags_ok = False
        self.post("/resume_memory_occupation", {}, timeout=600)
        self._released.clear()

    def resident_bytes(self) -> dict[str, int]:
        """SGLang's own sizes of its weights and KV pool (/server_info memory_usage, GB at load time),
        0 for the released ones; {} when the server does not report them."""
        if self._memory_sizes is None:
            try:
                info = self.call("GET", "/server_info", None, timeout=60)
                usage = info["internal_states"][0]["memory_usage"]
                self._memory_sizes = {"weights": max(int(usage["weight"] * 2**30), 0),
                                      "kv_cache": max(int(usage["kvcache"] * 2**30), 0)}
            except (SGLangServerError, KeyError, IndexError, TypeError):
                self._memory_sizes = {}
        return {tag: 0 if tag in self._released else n for tag, n in self._memory_sizes.items()}

    # ------------------------------------------------------------------------- weight updates

    def weight_problem(self, name: str, t: torch.Tensor) -> Exception | None:
        """Why the server's checkpoint has no tensor `name` of t's shape (None: it has)."""
        if self._shapes is None:
            return None
        if name not in self._shapes:
            return KeyError(f"unknown weight {name!r}: not in the checkpoint at {self.model_path}")
        if tuple(t.shape) != self._shapes[name]:
            return ValueError(f"weight {name!r} has shape {tuple(t.shape)}, the server's model has "
                              f"{self._shapes[name]}")
        return None

    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        transport: Literal["tensor", "distributed", "disk"] | None = None,
    ) -> None:
        """Stream HF-named tensors into the server in buckets of `bucket_mb`, then flush its cache
        (updates.py). `transport` overrides cfg.weight_sync for this call. Sets `last_update`."""
        transport = transport or self.cfg.weight_sync
        sync = self._updaters.get(transport)
        if sync is None:
            sync = NodeWeightSync.local([self], transport=transport, bucket_bytes=self.bucket_bytes,
                                        trainer_host=self.trainer_host, broadcast=self._weight_group,
                                        versions=self._versions)
            self._updaters[transport] = sync
        sync.bucket_bytes = self.bucket_bytes
        counts = sync.update(named_tensors)
        if counts.error is not None:
            raise counts.error

    # the steps of one update (updates.NodeWeightSync drives them, for one server or a node's)

    def begin_update(self, transport: str) -> None:
        if self.weights_released:  # (on CPU too: the shims lose released memory as CUDA does)
            raise EngineStateError(f"SGLang engine {self.url}: its weights are released: wake() them before "
                                   "update_weights()")
        if transport != "disk":  # SGLang 0.5.x refuses tensor and distributed updates outside a session
            self.post("/begin_weight_update", {})

    def end_update(self, transport: str, *, failed: bool = False) -> None:
        if failed and self.dead_reason() is not None:
            return
        if transport != "disk":
            self.post("/end_weight_update", {}, timeout=60 if failed else 600)
        if not failed:
            self.call("POST", "/flush_cache", None, timeout=600)

    def post_flat_bucket(self, payloads: Sequence[str], version: str) -> None:
        """One bucket, one pickled flat payload per TP rank (load_format "flattened_bucket")."""
        self.post("/update_weights_from_tensor", {"serialized_named_tensors": list(payloads),
                                                  "load_format": "flattened_bucket", "flush_cache": False,
                                                  "weight_version": version})

    def load_from_disk(self, folder: Path, version: str) -> None:
        self.post("/update_weights_from_disk", {"model_path": str(folder), "flush_cache": False,
                                                "weight_version": version})

    def took_weights_elsewhere(self) -> None:
        """An attached server took the weights from its own node's ranks (the sync raised on no rank)."""
        self.stale_weights = False

    def record_update(self, transport: str, counts: NodeSyncCounts) -> None:
        self.stale_weights = False
        self.last_update = WeightUpdateStats(seconds=counts.seconds, bytes=counts.bytes,
                                             tensors=counts.tensors, buckets=counts.buckets,
                                             transport=transport)

    def weight_version(self) -> str | None:
        """The server's current weight version string (bumped by every update_weights)."""
        info = self.call("GET", "/model_info", None, timeout=30)
        return info.get("weight_version") if isinstance(info, dict) else None
