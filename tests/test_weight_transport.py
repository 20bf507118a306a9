"""The weight transport into SGLang servers on CPU: which trainer
rank serialises the payload of which server TP rank, the device it names (by UUID, CUDA faked), the
flattened_bucket payload SGLang rebuilds, the per-rank gather protocol on two gloo ranks, and the weight
group's own store under torchrun."""

from __future__ import annotations

import io
import json
import pickle
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_dapo.rollout.sglang import transport
from megatron_dapo.rollout.sglang.updates import NodeLayout, NodeWeightSync, Slot, payload_plan

# ------------------------------------------------------------------------------------- payload plan


def test_each_colocated_rank_serialises_for_the_server_rank_on_its_gpu():
    """8 GPUs, SGLang TP=2: server k's TP rank j runs on GPU 2k + j, where trainer local rank 2k + j runs."""
    ranks = tuple(range(16, 24))  # node 2 of a job: global ranks 16..23
    plan = payload_plan(NodeLayout(node=2, ranks=ranks, servers=4, tp=2, colocated=True))
    assert plan == [Slot(k, j, 16 + 2 * k + j, 2 * k + j) for k in range(4) for j in range(2)]
    one = payload_plan(NodeLayout(node=0, ranks=tuple(range(8)), servers=1, tp=8, colocated=True))
    assert [(s.tp_rank, s.rank, s.gpu) for s in one] == [(j, j, j) for j in range(8)]


def test_without_a_trainer_rank_on_the_gpu_the_leader_serialises():
    # servers on their own GPUs: every payload from the leader's buffer (GPU 0)
    apart = payload_plan(NodeLayout(node=0, ranks=(0, 1, 2, 3), servers=2, tp=2, colocated=False))
    assert {(s.rank, s.gpu) for s in apart} == {(0, 0)}
    # 2 trainer ranks but 4 server GPUs: GPUs 2, 3 have no trainer rank
    short = payload_plan(NodeLayout(node=0, ranks=(4, 5), servers=1, tp=4, colocated=True))
    assert [(s.rank, s.gpu) for s in short] == [(4, 0), (5, 1), (4, 0), (4, 0)]


def _fake_cuda_reduction(monkeypatch, ordinal: int) -> None:
    """torch's CUDA reduction as it would answer for a tensor on GPU `ordinal` (args as torch 2.13 builds
    them: device at index 6), and device UUIDs, on a machine without CUDA."""
    from torch.multiprocessing import reductions

    def reduce_tensor(t):
        args = (type(t), t.size(), t.stride(), 0, torch.UntypedStorage, t.dtype, ordinal, b"handle", 64, 0,
                False, b"ref", 0, b"event", True)
        return reductions.rebuild_cuda_tensor, args

    monkeypatch.setattr(reductions, "reduce_tensor", reduce_tensor)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=f"GPU-uuid-{i}"))


class _Recorder(pickle.Unpickler):
    """Unpickles a payload, recording the arguments of CUDA rebuilds instead of calling them."""

    calls: list[tuple] = []

    def find_class(self, module, name):
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
            return lambda *args: _Recorder.calls.append(args) or "cuda-tensor"  # type: ignore[func-returns-value]
        return super().find_class(module, name)


def test_cuda_payload_names_the_device_by_uuid_not_ordinal(monkeypatch):
    _fake_cuda_reduction(monkeypatch, ordinal=3)
    flat = torch.zeros(16, dtype=torch.uint8)
    payload = transport.serialize_payload({"flattened_tensor": flat, "metadata": []})
    _Recorder.calls = []
    out = _Recorder(io.BytesIO(__import__("base64").b64decode(payload))).load()
    assert out["flattened_tensor"] == "cuda-tensor"
    (args,) = _Recorder.calls
    assert args[6] == "GPU-uuid-3" and args[7] == b"handle"  # SGLang's patched rebuild maps the UUID back
    from torch.multiprocessing import reductions

    assert reductions.reduce_tensor(torch.zeros(1))[1][6] == 3  # torch's own reduction is untouched


# SGLang 0.5.23's SafeUnpickler admits these globals among others (sglang/srt/utils/common.py)
_SGLANG_ALLOWED = {("builtins", "dict"), ("builtins", "list"), ("types", "SimpleNamespace"),
                   ("torch", "Size"), ("torch", "float32"), ("torch", "bfloat16"),
                   ("torch", "UntypedStorage"), ("torch._utils", "_rebuild_tensor"),
                   ("torch._utils", "_rebuild_tensor_v2"), ("torch.storage", "UntypedStorage"),
                   ("torch.multiprocessing.reductions", "rebuild_tensor"),
                   ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
                   ("torch.multiprocessing.reductions", "rebuild_typed_storage"), ("torch", "ByteStorage"),
                   ("torch", "uint8"), ("copyreg", "__newobj__"), ("torch", "Tensor")}


class _SafeLike(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) not in _SGLANG_ALLOWED:
            raise RuntimeError(f"Blocked unsafe global ({module}.{name})")
        return super().find_class(module, name)


def _rebuild(payload: str) -> dict[str, torch.Tensor]:
    """What SGLang's FlattenedTensorBucket.reconstruct_tensors makes of a payload."""
    data = _SafeLike(io.BytesIO(__import__("base64").b64decode(payload))).load()
    flat = data["flattened_tensor"]
    return {m.name: flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape) for m in data["metadata"]}


def test_flattened_bucket_payload_rebuilds_every_tensor_under_sglangs_allow_list():
    bucket = [("a.weight", torch.randn(3, 5)), ("b.bias", torch.randn(7).to(torch.bfloat16)),
              ("c.weight", torch.randn(2, 2))]
    flat, meta = transport.flat_bucket(bucket)
    out = _rebuild(transport.flat_payload(flat, meta))
    assert list(out) == [n for n, _ in bucket]
    for name, t in bucket:
        assert out[name].dtype == t.dtype and torch.equal(out[name], t)
    assert all(m.start_idx % 64 == 0 for m in meta)  # every dtype views in place


def test_a_bucket_larger_than_the_free_gpu_memory_is_refused_naming_the_setting(monkeypatch):
    from megatron_dapo.rollout.sglang.updates import bucket_room_problem

    on_gpu = SimpleNamespace(device=torch.device("cuda", 1), numel=lambda: 2**29,
                             element_size=lambda: 2)  # 1 GiB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (int(0.5 * 2**30), 80 * 2**30))
    problem = bucket_room_problem([("w", on_gpu)], 1024 * 2**20)
    assert str(problem) == ("a weight-sync bucket of 1.00 GiB does not fit in the 0.50 GiB free on cuda:1 in "
                            "the sync phase (rollout.weight_sync_bucket_mb=1024): lower it")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (2 * 2**30, 80 * 2**30))
    assert bucket_room_problem([("w", on_gpu)], 1024 * 2**20) is None
    assert bucket_room_problem([("w", torch.zeros(4))], 1) is None  # host memory: not checked here


# ---------------------------------------------------------------------- per-rank protocol (2 ranks)


class FakeServer:
    """The leader's view of one SGLang server, rebuilding each TP rank's payload as it arrives."""

    def __init__(self, tp: int, fail_at_bucket: int | None = None):
        self.cfg = SimpleNamespace(tensor_parallel=tp)
        self.weight_groups: list = []
        self.received: list[list[dict[str, list[float]]]] = []
        self.events: list[str] = []
        self.fail_at_bucket = fail_at_bucket

    def weight_problem(self, name, t):
        return None

    def begin_update(self, transport):
        self.events.append("begin")

    def end_update(self, transport, failed=False):
        self.events.append("end failed" if failed else "end")

    def post_flat_bucket(self, payloads, version):
        if self.fail_at_bucket == len(self.received):
            raise RuntimeError("server refused the bucket")
        self.received.append([{n: t.flatten().tolist() for n, t in _rebuild(p).items()} for p in payloads])

    def record_update(self, transport, counts):
        self.events.append(f"recorded {counts.buckets} buckets")


def _protocol_worker(rank, world, port, root, fail):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.new_group([0, 1], backend="gloo")
    server = FakeServer(tp=2, fail_at_bucket=1 if fail else None)
    layout = NodeLayout(node=0, ranks=(0, 1), servers=1, tp=2, colocated=True)
    sync = NodeWeightSync([server] if rank == 0 else [], layout, rank, transport="tensor", bucket_bytes=64,
                          group=group)
    # the same names and shapes on both ranks; the values tell which rank's buffer a payload came from
    stream = [("w1", torch.full((4,), float(rank))), ("w2", torch.full((12,), 10.0 + rank)),
              ("w3", torch.full((2,), 20.0 + rank))]
    counts = sync.update(stream)
    out = {"sent": counts.sent, "buckets": counts.buckets,
           "error": repr(counts.error) if counts.error else None, "received": server.received,
           "events": server.events}
    Path(root, f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


@pytest.mark.parametrize("fail", [False, True], ids=["ok", "server_fails"])
def test_each_rank_feeds_its_own_server_rank_and_the_leader_posts(tmp_path, fail):
    from spawn import run_ranks

    run_ranks(_protocol_worker, str(tmp_path), fail, timeout_s=120)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0["buckets"] == r1["buckets"] == 2  # 16 + 48 B, then 8 B: the same cut on both ranks
    assert r0["sent"] == r1["sent"] == 4 * (4 + 12 + 2)  # each rank copied one model for its server rank
    if fail:  # the leader stops posting but both ranks finish the protocol: nobody hangs
        assert "server refused the bucket" in r0["error"] and r1["error"] is None
        assert r0["events"] == ["begin", "end failed", "recorded 2 buckets"]
        return
    first, second = r0["received"]
    assert first == [{"w1": [0.0] * 4, "w2": [10.0] * 12}, {"w1": [1.0] * 4, "w2": [11.0] * 12}]
    assert second == [{"w3": [20.0] * 2}, {"w3": [21.0] * 2}]  # TP rank j's payload came from rank j
    assert r0["events"] == ["begin", "end", "recorded 2 buckets"] and r1["received"] == []


class DyingServer(FakeServer):
    """Its process dies at bucket `fail_at_bucket` (lost() then says so, as SGLangServer's does)."""

    dead = False

    def post_flat_bucket(self, payloads, version):
        self.dead = self.dead or self.fail_at_bucket == len(self.received)
        super().post_flat_bucket(payloads, version)

    def lost(self):
        return "exited with code -9" if self.dead else None


@pytest.mark.parametrize("restartable", [True, False])
def test_a_server_lost_mid_update_is_left_out_where_it_restarts(restartable):
    """Rank 0's node (its servers restartable): a server that dies takes no more of the update and the others take
    all of it, with no error (the caller restarts it and gives it the weights); elsewhere its loss is the error."""
    a, b = DyingServer(tp=1), DyingServer(tp=1, fail_at_bucket=1)
    sync = NodeWeightSync.local([a, b], transport="tensor", bucket_bytes=64)
    sync.restartable = restartable
    counts = sync.update([("w1", torch.ones(4)), ("w2", torch.ones(12)), ("w3", torch.ones(2))])
    if not restartable:
        assert "server refused the bucket" in repr(counts.error) and a.events[-2] == "end failed"
        return
    assert counts.error is None and counts.lost == [1] and len(a.received) == 2 and len(b.received) == 1
    assert a.events == ["begin", "end", "recorded 2 buckets"] and b.events == ["begin"]  # b: no end, not current


def test_only_the_restarted_server_takes_an_update_meant_for_it():
    a, b = DyingServer(tp=1), DyingServer(tp=1)
    sync = NodeWeightSync.local([a, b], transport="tensor", bucket_bytes=64)
    sync.only = [1]
    assert sync.update([("w1", torch.ones(4))]).error is None
    assert a.received == [] and a.events == [] and len(b.received) == 1 and b.events[-1] == "recorded 1 buckets"


# -------------------------------------------------------------------- the weight group's own store


_PEER = textwrap.dedent("""
    import os, sys
    from datetime import timedelta
    import torch, torch.distributed as dist
    from torch.distributed.distributed_c10d import (Backend, PrefixStore, _new_process_group_helper, _world,
                                                    rendezvous)
    port, name = int(sys.argv[1]), sys.argv[2]
    store, rank, world = next(rendezvous(f"tcp://127.0.0.1:{port}", 1, 2, timeout=timedelta(seconds=60)))
    pg, _ = _new_process_group_helper(2, 1, [], Backend("gloo"), PrefixStore(name, store), group_name=name,
                                      backend_options=None, timeout=timedelta(seconds=60))
    _world.pg_group_ranks[pg] = {0: 0, 1: 1}
    t = torch.zeros(3)
    dist.broadcast(t, src=0, group=pg)
    print(t.tolist(), flush=True)
    os._exit(0)  # gloo's teardown at interpreter exit may abort ("terminate called") while rank 0 holds the pair
""")


def test_weight_group_store_is_served_by_us_under_torchrun(monkeypatch, python_env):
    """Under torchrun (TORCHELASTIC_USE_AGENT_STORE=True) torch's tcp:// rendezvous makes a client-only store
    that nobody serves: the group would never form. Ours serves its store; a peer joining as SGLang does
    (tcp:// rendezvous, rank 1) receives the broadcast."""
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    listener = transport.listening_socket("127.0.0.1")
    port = listener.getsockname()[1]
    env = {k: v for k, v in python_env.items() if not k.startswith("TORCHELASTIC")}
    peer = subprocess.Popen([sys.executable, "-c", _PEER, str(port), "g_test"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pg = transport.init_custom_process_group("gloo", listener, 2, "g_test", timedelta(seconds=20))
        torch.distributed.broadcast(torch.tensor([1.0, 2.0, 3.0]), src=0, group=pg)
        out, err = peer.communicate(timeout=60)
        assert peer.returncode == 0, err[-2000:]
        assert out.strip() == "[1.0, 2.0, 3.0]"
        torch.distributed.destroy_process_group(pg)
    finally:
        peer.kill()
        listener.close()
