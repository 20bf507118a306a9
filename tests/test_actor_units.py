"""Actor pieces that need no process group: HF config validation, packing, launch env, the CPU layer."""

import subprocess
import sys

import pytest
import torch

from megatron_dapo.actor.batching import micro_batches, pack_rows, split_rows
from megatron_dapo.actor.model import UnsupportedModelError, spec_from_hf, validate_layout
from megatron_dapo.parallel import launch_env
from megatron_dapo.tiny import tiny_config
from megatron_dapo.types import TrainBatch


def qwen2(**kw):
    base = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return tiny_config("qwen2", **{**base, **kw})


def test_spec_reads_qwen2_and_llama():
    s = spec_from_hf(qwen2(rope_theta=1e6, rms_norm_eps=1e-5))
    assert (s.family, s.num_kv_heads, s.head_dim, s.qkv_bias, s.rope_theta, s.norm_eps) == \
        ("qwen2", 2, 16, True, 1e6, 1e-5)
    assert s.padded_vocab_size(tp=1) == 384 and s.padded_vocab_size(tp=4) == 512
    llama = spec_from_hf(tiny_config("llama", tied=True, vocab_size=300, hidden_size=64, intermediate_size=96,
                                     num_attention_heads=8, num_key_value_heads=8))
    assert (llama.family, llama.qkv_bias, llama.tied_embeddings, llama.head_dim) == ("llama", False, True, 8)


@pytest.mark.parametrize("kw, field", [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
])
def test_unsupported_configs_name_the_field(kw, field):
    with pytest.raises((UnsupportedModelError, ValueError), match=field):
        spec_from_hf(qwen2(**kw))


def test_unknown_architecture():
    from transformers import GPT2Config

    with pytest.raises(UnsupportedModelError, match="supported are"):
        spec_from_hf(GPT2Config())


@pytest.mark.parametrize("tp, pp, field", [(3, 1, "num_attention_heads"), (4, 1, "num_key_value_heads"),
                                           (1, 3, "num_hidden_layers")])
def test_layout_must_divide(tp, pp, field):
    with pytest.raises(UnsupportedModelError, match=field):
        validate_layout(spec_from_hf(qwen2()), tp, pp)


def test_pack_rows_respects_the_token_budget():
    lengths = [10, 3, 7, 10, 2, 30, 5]
    packs = pack_rows(lengths, token_budget=20)
    assert sorted(i for p in packs for i in p) == list(range(len(lengths)))
    for p in packs:
        assert len(p) == 1 or len(p) * max(lengths[i] for i in p) <= 20
    assert [5] in packs  # longer than the budget: alone
    assert pack_rows(lengths, 20) == packs  # deterministic


def test_rows_packed_one_after_the_other():
    """pack_sequences (Megatron's thd format): the rows' tokens back to back at their own positions, cu_seqlens
    at their starts, the map back to the rows; padded to a multiple with a sequence of padding; and the
    micro-batches' sum of lengths within the budget."""
    from megatron_dapo.actor.batching import pack_sequences

    b = TrainBatch(input_ids=torch.arange(40).view(4, 10), loss_mask=torch.ones(4, 10),
                   advantages=torch.zeros(4), lengths=torch.tensor([10, 4, 6, 3]))
    packed = pack_sequences(b, [2, 1, 3], multiple=4)
    assert packed.input_ids.tolist() == [[*range(20, 26), *range(10, 14), *range(30, 33), 0, 0, 0]]
    assert packed.position_ids.tolist() == [[*range(6), *range(4), *range(3), *range(3)]]
    assert packed.cu_seqlens.tolist() == [0, 6, 10, 13, 16] and packed.cu_seqlens.dtype == torch.int32
    assert packed.attention_mask is None and packed.real_tokens == 13
    stats = packed.input_ids.float()
    rows = packed.to_rows(stats)
    want = b.input_ids[[2, 1, 3], :6].float() * (torch.arange(6) < torch.tensor([6, 4, 3])[:, None])
    want[:, 0] = 0  # position 0 has no statistic
    assert torch.equal(rows, want)
    assert pack_sequences(b, [0, 1], multiple=1).cu_seqlens.tolist() == [0, 10, 14]
    lengths = [10, 3, 7, 10, 2, 30, 5]
    packs = pack_rows(lengths, token_budget=20, padded=False)
    assert sorted(i for p in packs for i in p) == list(range(len(lengths)))
    assert all(len(p) == 1 or sum(lengths[i] for i in p) <= 20 for p in packs) and [5] in packs
    mbs = micro_batches(b, token_budget=14, thd=1)
    assert [m.rows.tolist() for m in mbs] == [[0], [2, 1, 3]]  # longest first, 13 <= 14 positions
    assert all(m.token_counts()[1] == 0 for m in mbs)  # no padding computed
    assert mbs[1].model_kwargs("cpu")["packed_seq_params"].max_seqlen_q == 6
    assert micro_batches(b, token_budget=14)[0].model_kwargs("cpu") == {}


def test_micro_batches_trim_padding():
    b = TrainBatch(input_ids=torch.arange(40).view(4, 10), loss_mask=torch.ones(4, 10),
                   advantages=torch.tensor([1.0, 2, 3, 4]), lengths=torch.tensor([10, 4, 6, 3]),
                   old_logprobs=torch.zeros(4, 10))
    mbs = micro_batches(b, token_budget=12)
    assert sorted(torch.cat([m.rows for m in mbs]).tolist()) == [0, 1, 2, 3]
    for m in mbs:
        assert m.shape[1] == max(b.lengths[m.rows]).item()
        assert torch.equal(m.input_ids, b.input_ids[m.rows, :m.shape[1]])
        assert torch.equal(m.advantages, b.advantages[m.rows])
    with pytest.raises(ValueError, match="equal mini-batches"):
        split_rows(b, 3)
    assert [len(x) for x in split_rows(b, 2)] == [2, 2]


def test_launch_env_torchrun_slurm_and_alone():
    tr = launch_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "n1", "MASTER_PORT": "1234"})
    assert (tr.rank, tr.world_size, tr.local_rank, tr.master_addr, tr.master_port) == (3, 8, 1, "n1", 1234)
    sl = launch_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "5", "MASTER_ADDR": "node7",
                     "MASTER_PORT": "29600"})
    assert (sl.rank, sl.world_size, sl.local_rank, sl.master_addr, sl.master_port) == (5, 16, 5, "node7", 29600)
    alone = launch_env({})
    assert (alone.rank, alone.world_size, alone.node_rank) == (0, 1, 0)
    assert tr.node_rank == 0 and sl.node_rank == 0
    assert launch_env({"RANK": "9", "WORLD_SIZE": "16", "GROUP_RANK": "1"}).node_rank == 1
    assert launch_env({"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_NODEID": "2"}).node_rank == 2


def test_cpu_layer_maps_cuda_to_cpu_only_without_cuda(python_env):
    code = r"""
import torch
from megatron_dapo import megatron_cpu
assert megatron_cpu.enable() is True
assert torch.zeros(2, device="cuda").device.type == "cpu"
assert torch.ones(1, device=torch.cuda.current_device()).device.type == "cpu"
assert torch.ones(2).cuda().device.type == "cpu"
assert torch.ones(2).to("cuda:0").device.type == "cpu"
assert torch.ones(2).type() == "torch.cuda.FloatTensor"
assert torch.ones(2).new_empty(3, 4).shape == (3, 4)  # sizes, not CUDA ordinals
assert torch.ones(2).new_empty((3,), device="cuda").device.type == "cpu"
torch.cuda.synchronize()
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=python_env, timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


def test_cpu_layer_patches_nothing_when_cuda_exists(python_env):
    code = r"""
import torch
torch.cuda.is_available = lambda: True
orig = (torch.cuda.current_device, torch.cuda.synchronize)
from megatron_dapo import megatron_cpu
assert megatron_cpu.enable() is False and not megatron_cpu.is_enabled()
assert (torch.cuda.current_device, torch.cuda.synchronize) == orig
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=python_env, timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]
