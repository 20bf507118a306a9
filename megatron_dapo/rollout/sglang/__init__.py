"""SGLang rollouts: SGLang servers driven over HTTP from the trainer's python (no sglang import here).

- `server.py`: one `sglang.launch_server` process (launch flags, start, readiness, death watch, stop)
  and its bounded HTTP calls; `process.py`: the process-tree helpers under it.
- `engine.py`: `SGLangEngine`, one server as a `RolloutEngine` (generate, abort, sleep/wake, health,
  weight updates over the three transports).
- `wire.py`: the wire formats, as pure functions (weight buckets, /generate payloads).
- `transport.py`: moving weights (shared-memory tensors, the broadcast process group).
- `fleet.py`: the servers of a job (several per node, every node's, one shared broadcast).
- `cpu_shims/`: loaded into the SGLang venv (tools/sglang_venv.sh), never by the trainer.
"""
