"""The MoE router in fp32, as the engines compute it: in bf16, the actor's top-k expert choices against
transformers' (bf16 weights, fp32 softmax and top-k, as SGLang's fused top-k) with Megatron's default router dtype
(the model's) and with ours. Independent reference: transformers' own router indices."""

import pytest
import torch

from megatron_dapo import parallel
from megatron_dapo.actor import model as model_mod
from megatron_dapo.config import Config
from megatron_dapo.tiny import tiny_model

TOKENS = torch.randint(0, 200, (4, 48), generator=torch.Generator().manual_seed(0))


def _hf_routes(hf) -> list[torch.Tensor]:
    routes: list[torch.Tensor] = []
    for layer in hf.model.layers:
        layer.mlp.gate.register_forward_hook(lambda _m, _i, out: routes.append(out[2].sort(-1).values))
    with torch.no_grad():
        hf(TOKENS)
    return routes


def _actor_routes(folder, router_dtype: str | None, monkeypatch) -> list[torch.Tensor]:
    """Top-k experts [b * s, k] (sorted) of each layer of the bf16 actor; `router_dtype` None = Megatron's default."""
    from megatron_dapo.actor.convert_verify import megatron_logits
    from megatron_dapo.actor.hf_io import load_hf_weights
    from megatron_dapo.hf_files import SafetensorsReader

    fields = model_mod._moe_fields
    monkeypatch.setattr(model_mod, "_moe_fields", lambda moe, grouped: {**fields(moe, grouped), "moe_router_dtype": router_dtype})
    cfg = Config()
    cfg.model.dtype = "bfloat16"
    spec = model_mod.spec_from_hf(model_mod.load_hf_config(folder))
    model = model_mod.build_model(spec, cfg.model, cfg.parallel, init_weights=False)
    load_hf_weights(model, SafetensorsReader(folder), spec)
    maps: list[torch.Tensor] = []
    for layer in model.decoder.layers:
        layer.mlp.router.register_forward_hook(lambda _m, _i, out: maps.append(out[1]))
    megatron_logits(model, TOKENS, spec.vocab_size)
    b, s = TOKENS.shape
    k = spec.moe.top_k
    # Megatron's tokens are [s, b]; the routing map [tokens, experts] holds k experts a token, in order
    return [m.nonzero()[:, 1].view(s, b, k).transpose(0, 1).reshape(-1, k) for m in maps]


@pytest.fixture(scope="module")
def one_rank():
    parallel.initialize(Config().parallel, seed=1)
    yield
    parallel.destroy()


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize(("family", "pre_softmax"), [("qwen2_moe", True), ("qwen3_moe", False)])
def test_the_fp32_router_picks_the_experts_transformers_picks(family, pre_softmax, tmp_path, monkeypatch):
    """A pre-softmax router (Qwen2-MoE, norm_topk_prob off) took its top-k from bf16-rounded probabilities:
    measured 86-87% of (token, layer) agreeing with transformers, 97-98% in fp32; a router that takes the top-k of
    the logits (Qwen3-MoE) agrees as well either way (the rest is bf16 noise in the hidden states)."""
    from transformers import AutoModelForCausalLM

    over = {"norm_topk_prob": False} if pre_softmax else {}
    tiny_model(family, seed=3, vocab_size=200, max_position_embeddings=128, eos_token_id=199, num_experts=64,
               num_experts_per_tok=8, **over).save_pretrained(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, attn_implementation="eager").eval()
    ref = _hf_routes(hf)

    def agreement(router_dtype):
        routes = _actor_routes(tmp_path, router_dtype, monkeypatch)
        return min((a == r).all(-1).float().mean().item() for a, r in zip(routes, ref))

    default, fp32 = agreement(None), agreement("fp32")
    assert fp32 > 0.95, fp32
    if pre_softmax:
        assert fp32 > default + 0.05, (default, fp32)
    else:
        assert fp32 >= default - 0.02, (default, fp32)
