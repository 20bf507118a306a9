"""The rotary embedding the actor runs: Transformer Engine's fused kernel wherever the TE layer spec is (megatron-core's
unfused one syncs the device and loops over the packed sequences in every layer), megatron-core's unfused one with the
local spec; the start-up summary names the choice. `gpu`: the fused kernel equals the unfused one on padded and
packed (thd) rows."""

from __future__ import annotations

import types

import pytest
import torch

from megatron_dapo.actor import model as model_mod
from megatron_dapo.config import Config
from megatron_dapo.tiny import tiny_config


def _tc(cfg: Config):
    cfg.model.dtype = "float32"
    return model_mod.transformer_config(model_mod.spec_from_hf(tiny_config("qwen2")), cfg.model, cfg.parallel)


def _fake_te(monkeypatch, *, thd: bool = True):
    from megatron.core.models.common.embeddings import rope_utils

    monkeypatch.setattr(model_mod, "use_transformer_engine", lambda cfg: True)
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", lambda *a, **k: None)
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb_thd", (lambda *a, **k: None) if thd else None)


def test_local_spec_keeps_the_unfused_rotary_embedding():
    cfg = Config()
    cfg.model.transformer_impl = "local"
    assert _tc(cfg).apply_rope_fusion is False
    assert model_mod.attention_kernel(cfg.model).endswith("rotary embedding unfused (megatron-core)")


def test_transformer_engine_fuses_the_rotary_embedding(monkeypatch):
    _fake_te(monkeypatch)
    cfg = Config()
    assert _tc(cfg).apply_rope_fusion is True
    assert model_mod.attention_kernel(cfg.model) == "Transformer Engine's, rotary embedding fused (Transformer Engine)"


def test_a_transformer_engine_without_the_fused_thd_kernel_stays_unfused(monkeypatch):
    _fake_te(monkeypatch, thd=False)
    assert _tc(Config()).apply_rope_fusion is False


def test_per_row_positions_refuse_a_fused_model():
    model = types.SimpleNamespace(rotary_pos_emb=object(), config=types.SimpleNamespace(apply_rope_fusion=True))
    with pytest.raises(RuntimeError, match="unfused rotary embedding"):
        with model_mod.rotary_positions(model, torch.zeros(1, 4, dtype=torch.long)):
            pass


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_rope_equals_unfused_on_padded_and_packed_rows(tmp_path):
    pytest.importorskip("transformer_engine")
    import torch.distributed as dist
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer import TransformerConfig

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    group = dist.group.WORLD
    configs = {flag: TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, apply_rope_fusion=flag)
               for flag in (False, True)}
    freqs = RotaryEmbedding(kv_channels=16, rotary_percent=1.0, rotary_base=10000)(12).cuda()
    gen = torch.Generator(device="cuda").manual_seed(0)
    sbhd = torch.randn(12, 3, 4, 16, device="cuda", generator=gen)
    got = {f: apply_rotary_pos_emb(sbhd, freqs, configs[f], cp_group=group) for f in configs}
    torch.testing.assert_close(got[True], got[False], rtol=1e-5, atol=1e-5)
    cu = torch.tensor([0, 5, 12, 20], dtype=torch.int32, device="cuda")  # three packed rows of 5, 7 and 8 tokens
    thd = torch.randn(20, 4, 16, device="cuda", generator=gen)
    got = {f: apply_rotary_pos_emb(thd, freqs, configs[f], cu_seqlens=cu, cp_group=group) for f in configs}
    torch.testing.assert_close(got[True], got[False], rtol=1e-5, atol=1e-5)
