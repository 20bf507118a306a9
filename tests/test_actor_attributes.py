"""Megatron reads flags off the parameters it builds: `tensor_model_parallel` / `partition_dim` /
`partition_stride` (the grad norm counts a TP shard once, checkpoints reshard by them), `allreduce`,
`sequence_parallel`, `shared` / `shared_embedding` (the tied embedding's copy on the last pipeline
stage) and `is_embedding_or_output_parameter`; for routed experts `allreduce=False` under expert
parallel (the optimizer keeps them apart: reduced over the expert-data-parallel group, their grad norm
summed over the expert-parallel ranks). A model built to be loaded from a checkpoint (init_weights=False)
must carry exactly the flags of a randomly initialised one, on every rank.
"""

from __future__ import annotations

import os

import pytest
import torch
from spawn import run_ranks

DENSE, MOE = ("qwen2",), ("qwen2_moe",)
"""MoE: every kind of MoE parameter (router, routed experts, shared expert and its gate)."""
LAYOUTS = {  # name: (tensor_parallel, pipeline_parallel, expert_parallel, ranks, model.transformer_impl, families)
    "tp1": (1, 1, 1, 1, "local", DENSE),
    "tp2": (2, 1, 1, 2, "local", DENSE + MOE),
    "pp2": (1, 2, 1, 2, "local", DENSE),
    "ep2": (1, 1, 2, 2, "local", MOE),
    "tp1_te": (1, 1, 1, 1, "transformer_engine", DENSE + MOE),  # gpu tier (one GPU: one rank)
}
TP_SHARDED = ("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight", "linear_qkv.bias",
              "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight")


def _flags(model: torch.nn.Module) -> dict[str, dict]:
    """Every parameter's Python attributes (what Megatron sets with setattr), by parameter name."""
    return {name: dict(vars(p)) for name, p in model.named_parameters()}


def _build_all(tp: int, pp: int, ep: int, impl: str, families: tuple[str, ...]
               ) -> dict[tuple[str, bool, bool], dict[str, dict]]:
    """Flags of the model built with/without random init, tied/untied, of each family. (Sequence parallel needs the Transformer Engine spec: the local spec's torch norm refuses it,
    so it is not built on CPU.)"""
    from megatron_dapo.actor.model import build_model, spec_from_hf
    from megatron_dapo.config import Config
    from megatron_dapo.tiny import tiny_config

    out = {}
    for family in families:
        for tied in (False, True):
            spec = spec_from_hf(tiny_config(family, tied=tied, vocab_size=200, max_position_embeddings=128))
            cfg = Config()
            cfg.model.dtype, cfg.model.transformer_impl = "float32", impl  # type: ignore[assignment]
            cfg.parallel.tensor_parallel, cfg.parallel.pipeline_parallel = tp, pp
            cfg.parallel.expert_parallel = ep
            for init in (True, False):
                out[(family, tied, init)] = _flags(build_model(spec, cfg.model, cfg.parallel, init_weights=init))
    return out


def _worker(rank: int, world_size: int, port: int, tp: int, pp: int, ep: int, impl: str, families: tuple[str, ...],
            out_dir: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from megatron_dapo import parallel
    from megatron_dapo.config import ParallelConfig

    parallel.initialize(ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, expert_parallel=ep), seed=3,
                        timeout_s=120)
    try:
        flags = _build_all(tp, pp, ep, impl, families)
        stage = {"first": parallel.is_first_stage(), "last": parallel.is_last_stage()}
        torch.save({"flags": flags, "stage": stage}, f"{out_dir}/rank_{rank}.pt")
    finally:
        parallel.destroy()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """built(layout) -> per-rank results, each layout spawned once (on first use)."""
    results = {}

    def get(name: str) -> list[dict]:
        if name not in results:
            tp, pp, ep, ranks, impl, families = LAYOUTS[name]
            out = tmp_path_factory.mktemp(name)
            run_ranks(_worker, tp, pp, ep, impl, families, str(out), nprocs=ranks, timeout_s=300)
            results[name] = [torch.load(out / f"rank_{r}.pt", weights_only=False) for r in range(ranks)]
        return results[name]

    return get


@pytest.mark.parametrize("layout", [pytest.param("tp1", marks=pytest.mark.slow), "tp2",
                                    pytest.param("pp2", marks=pytest.mark.slow), "ep2",
                                    pytest.param("tp1_te", marks=pytest.mark.gpu)])
def test_flags_without_init_equal_flags_with_init(built, layout):
    if LAYOUTS[layout][4] == "transformer_engine":
        pytest.importorskip("transformer_engine")
    for rank in built(layout):
        flags = rank["flags"]
        assert len(flags) == 4 * len(LAYOUTS[layout][5])
        for family, tied, init in flags:
            assert flags[(family, tied, False)] == flags[(family, tied, True)], (layout, family, tied)


def test_tensor_parallel_shards_are_flagged(built):
    """The comparison above is not between two empty sets: at TP2 every sharded matrix says so, with
    Megatron's partition dim and stride (the gated fc1 holds [gate; up] interleaved: stride 2); the MoE
    model's experts and shared expert too, while its router and shared-expert gate stay replicated."""
    for rank in built("tp2"):
        for (family, tied, init), flags in rank["flags"].items():
            if family != "qwen2":
                continue
            sharded = {n: f for n, f in flags.items() if n.endswith(TP_SHARDED)}
            assert len(sharded) == 2 + 5 * 2 - tied, (tied, sorted(sharded))
            for name, f in sharded.items():
                assert f["tensor_model_parallel"] is True, (name, init)
                dim = 1 if name.endswith(("linear_proj.weight", "linear_fc2.weight")) else 0
                stride = 2 if name.endswith("linear_fc1.weight") else 1
                assert (f["partition_dim"], f["partition_stride"]) == (dim, stride), (name, f)
            replicated = [n for n, f in flags.items() if n not in sharded]
            assert replicated and all(not flags[n].get("tensor_model_parallel", False) for n in replicated)
            linear = [f for n, f in sharded.items() if "word_embeddings" not in n]
            assert all(f["allreduce"] for f in linear)  # DP all-reduces them (experts under EP would not)
        moe = {n: f for (fam, _, _), flags in rank["flags"].items() if fam == "qwen2_moe" for n, f in flags.items()}
        for name, f in moe.items():
            if name.endswith(TP_SHARDED):
                stride = 2 if name.endswith("linear_fc1.weight") else 1
                assert f["tensor_model_parallel"] is True and f["partition_stride"] == stride, (name, f)
            elif ".mlp." in name:
                assert not f.get("tensor_model_parallel", False), (name, f)
        assert sum(".experts.local_experts." in n for n in moe) == 2 * 4 * 2  # layers x experts x (fc1, fc2)


def test_tied_embedding_copy_is_shared_across_pipeline_stages(built):
    """PP2 tied: the last stage's copy of the embedding is `shared` (the grad norm skips it, the
    embedding group all-reduces it); the first stage's is `shared_embedding`; untied: neither."""
    for rank in built("pp2"):
        for (family, tied, init), flags in rank["flags"].items():
            if rank["stage"]["last"]:
                out = flags["output_layer.weight"]
                assert out.get("shared", False) is tied and out.get("shared_embedding", False) is tied, init
            else:
                emb = flags["embedding.word_embeddings.weight"]
                assert emb.get("shared_embedding", False) is tied and not emb.get("shared", False), init


def test_routed_experts_are_kept_out_of_the_data_parallel_all_reduce(built):
    """EP2: each rank holds 2 of the 4 experts per layer; their weights say `allreduce=False` (Megatron's
    optimizer and DDP put them in the expert-parallel buffers and grad norm), everything else (attention,
    shared expert) `allreduce=True`; router and shared-expert gate are plain replicated weights."""
    for rank in built("ep2"):
        for (family, tied, init), flags in rank["flags"].items():
            experts = {n: f for n, f in flags.items() if ".experts.local_experts." in n}
            assert len(experts) == 2 * 2 * 2, sorted(experts)  # layers x local experts x (fc1, fc2)
            assert all(f["allreduce"] is False for f in experts.values()), (init, experts)
            dense = [f for n, f in flags.items() if n not in experts and "allreduce" in f]
            assert dense and all(f["allreduce"] is True for f in dense)
            assert any(".shared_experts.linear_fc1" in n for n in flags)
            for name in ("mlp.router.weight", "mlp.shared_experts.gate_weight"):
                f = flags[f"decoder.layers.0.{name}"]
                assert f == {"sequence_parallel": False}, (name, f)
