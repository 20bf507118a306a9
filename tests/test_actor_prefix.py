"""actor.shared_prefix: each group's prompt computed once (actor/prefix.py). The packed layout gives every
position exactly the (position, token) context it has in its own row (checked here without a model); the
Megatron actor then gives the same pi_old logprobs, losses and gradients as per row at TP1, TP2 and PP2, and
for a mixture-of-experts model (tests/workers/prefix_worker.py under torchrun, gloo), as do rows packed in
Megatron's thd format against a right-padded batch, and Megatron's dense-mask attention against SDPA's blocks;
and the step's token monitors."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from workers.prefix_worker import CASES, GROUPS, grouped_batch

from megatron_dapo.actor.batching import micro_batches
from megatron_dapo.actor.prefix import Unit, group_rows, pack_bins, pack_units, prefix_units
from megatron_dapo.config import ActorConfig
from megatron_dapo.parallel import free_port
from megatron_dapo.types import TrainBatch

WORKER = Path(__file__).parent / "workers" / "prefix_worker.py"


def test_units_share_each_groups_longest_common_prefix():
    batch = grouped_batch()
    units = prefix_units(batch, token_budget=1000)
    assert [u.rows for u in units] == [tuple(range(4 * k, 4 * k + 4)) for k in range(len(GROUPS))]
    for u, (prompt, lengths, lead) in zip(units, GROUPS):
        assert u.shared == prompt + lead  # the prompt, plus the tokens every response starts with
        assert u.packed_len == u.shared - 1 + sum(n + prompt - u.shared + 1 for n in lengths)
    assert sum(u.packed_len for u in units) < int(batch.lengths.sum())


def test_a_group_is_shared_only_where_it_costs_less():
    """Two rows of 10 tokens sharing 6: packed 5 + 2 x 5 = 15 positions. At pair cost c the unit costs
    15 + 225 c, the rows apart 2 x (10 + 100 c): sharing pays for c < 0.2."""
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 5, 6, 17, 18, 19, 20]])
    batch = TrainBatch(input_ids=ids, loss_mask=torch.ones(2, 10), advantages=torch.zeros(2),
                       lengths=torch.tensor([10, 10]), prompt_index=torch.tensor([0, 0]))
    shared = prefix_units(batch, token_budget=100, pair_cost=0.19)
    assert [(u.rows, u.shared, u.packed_len) for u in shared] == [((0, 1), 6, 15)]
    apart = prefix_units(batch, token_budget=100, pair_cost=0.21)
    assert [u.rows for u in apart] == [(0,), (1,)]


def test_the_pair_cost_is_the_models_flop_ratio():
    """SmolLM2-135M's shape: q = 9 x 64 = 576, kv = 3 x 64 = 192; per token 576 x (576 + 384) + 576 x 576 +
    3 x 576 x 1536 multiply-adds in the linear maps, 2 x 576 per query-key pair."""
    from megatron_dapo.actor.model import ModelSpec

    spec = ModelSpec(family="llama", num_layers=30, hidden_size=576, ffn_hidden_size=1536, num_heads=9,
                     num_kv_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192, rope_theta=1e5,
                     norm_eps=1e-5, qkv_bias=False, tied_embeddings=True)
    assert spec.attention_pair_cost() == 2 * 576 / (576 * 960 + 576 * 576 + 3 * 576 * 1536)


def test_a_group_longer_than_the_budget_is_split():
    batch = grouped_batch()
    units = prefix_units(batch, token_budget=20)
    assert sorted(i for u in units for i in u.rows) == list(range(len(batch)))
    assert len(units) > len(GROUPS)
    for u in units:
        assert u.packed_len <= 20 or len(u.rows) == 1
        if len(u.rows) == 1:  # a row on its own is computed as it is
            assert u == Unit.alone(u.rows[0], int(batch.lengths[u.rows[0]]))


def context(ids: torch.Tensor, pos: torch.Tensor, masked: torch.Tensor, q: int) -> list[tuple[int, int]]:
    """(position, token) of every key packed position q attends to, q included."""
    keys = (~masked[q]).nonzero().flatten().tolist()
    return sorted((int(pos[k]), int(ids[k])) for k in keys)


def bins_of(batch: TrainBatch, budget: int) -> list[list[Unit]]:
    """All the units of `batch`, packed as the first micro-batch of a budget would be (whatever its size)."""
    units = prefix_units(batch, token_budget=budget)
    return [[units[i] for i in seq] for bins in pack_bins([u.packed_len for u in units], budget) for seq in bins]


def test_pack_bins():
    lengths = [10, 3, 7, 10, 2, 30, 5, 4]
    micro = pack_bins(lengths, token_budget=40)
    assert sorted(i for bins in micro for seq in bins for i in seq) == list(range(len(lengths)))
    assert micro[0] == [[5]]  # 30 long: one more 30-long sequence would pass the budget
    for bins in micro:
        width = max(sum(lengths[i] for i in seq) for seq in bins)
        assert width == max(lengths[i] for seq in bins for i in seq)  # no sequence longer than its longest unit
        assert len(bins) * width <= 40
    assert micro[1] == [[0], [3], [2, 1], [6, 7]] and micro[2] == [[4]]


@pytest.mark.parametrize("budget", [1000, 40, 20])
def test_every_row_position_sees_exactly_its_own_row(budget):
    """The exactness argument, checked position by position: the packed position that serves row j at t
    holds token t at position t and attends to exactly (s, token s) for s <= t of row j."""
    batch = grouped_batch()
    bins = bins_of(batch, budget)
    packed = pack_units(batch, bins)
    units = [u for seq in bins for u in seq]
    rows = [i for u in units for i in u.rows]
    width = packed.input_ids.shape[1]
    for j, row in enumerate(rows):
        n = int(batch.lengths[row])
        tokens = batch.input_ids[row, :n].tolist()
        assert packed.valid[j].tolist() == [t < n for t in range(packed.valid.shape[1])]
        for t in range(n):
            p, q = divmod(int(packed.gather[j, t]), width)
            ids, pos, masked = packed.input_ids[p], packed.position_ids[p], packed.attention_mask[p, 0]
            assert (int(pos[q]), int(ids[q])) == (t, tokens[t])
            assert context(ids, pos, masked, q) == list(enumerate(tokens[: t + 1]))
            if t > 0:  # the kernels read token t's logprob from the logits of the packed position before q
                assert context(ids, pos, masked, q - 1) == list(enumerate(tokens[:t]))
    assert packed.real_tokens == sum(u.packed_len for u in units)


def test_to_rows_maps_statistics_back_and_zeroes_padding():
    batch = grouped_batch()
    packed = pack_units(batch, [[u] for u in prefix_units(batch, token_budget=1000)])
    stats = packed.position_ids.float().requires_grad_()  # statistic = the position: easy to read back
    rows = packed.to_rows(stats)
    want = torch.arange(rows.shape[1]).float().expand_as(rows) * packed.valid
    assert torch.equal(rows, want)
    rows.sum().backward()  # a shared prefix position collects the gradient of every row that reads it
    assert stats.grad[0, 1] == 4 and stats.grad[0, 0] == 0  # position 0 has no predecessor: no statistic


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("which", ["loss", "response"])
def test_the_output_layer_computes_exactly_the_needed_positions(shared, which):
    """model_loss_mask (the update's) and model_response_mask (pi_old's) mark the model's positions whose
    statistics a loss / generated token reads: mapped back to the rows they are the loss / response mask (so
    no prompt position is marked; the truncated response is generated but out of the loss)."""
    batch = grouped_batch()
    assert (batch.response_mask > batch.loss_mask).any()
    for mb in micro_batches(batch, 40, shared_prefix=shared):
        needed = mb.model_loss_mask if which == "loss" else mb.model_response_mask()
        rows = mb.loss_mask if which == "loss" else mb.response_mask
        assert needed.shape == mb.model_shape and (mb.packed is not None) == shared
        assert torch.equal(mb.to_rows(needed.float()), (rows > 0).float())
        tokens = int((rows > 0).sum())  # rows may share their first response tokens: fewer positions
        assert 0 < int(needed.sum()) <= tokens and (int(needed.sum()) == tokens or shared)
        assert not needed[:, 0].any() and int(needed.sum()) < mb.model_shape[0] * mb.model_shape[1]


def test_groups_without_prompt_index():
    batch = grouped_batch()
    by_tokens = TrainBatch(input_ids=batch.input_ids, loss_mask=batch.loss_mask, advantages=batch.advantages,
                           lengths=batch.lengths, response_mask=batch.response_mask)
    assert group_rows(by_tokens) == group_rows(batch) == [[4 * k + i for i in range(4)] for k in range(4)]
    unknown = TrainBatch(input_ids=batch.input_ids, loss_mask=batch.loss_mask, advantages=batch.advantages,
                         lengths=batch.lengths)
    assert group_rows(unknown) == [[i] for i in range(len(batch))]
    plain = micro_batches(unknown, 40, shared_prefix=True)  # nothing known to be shared: per row
    assert all(m.packed is None for m in plain)


def test_token_counts():
    batch = grouped_batch()
    total = int(batch.lengths.sum())
    plain = [m.token_counts() for m in micro_batches(batch, 40)]
    assert sum(c[2] for c in plain) == total
    assert sum(c[0] - c[1] for c in plain) == total  # per row, every non-padding position is a row token
    shared = [m.token_counts() for m in micro_batches(batch, 40, shared_prefix=True)]
    assert sum(c[2] for c in shared) == total
    assert sum(c[0] - c[1] for c in shared) == sum(u.packed_len for u in prefix_units(batch, 40))


def test_config_resolution():
    assert ActorConfig().resolved_shared_prefix(transformer_engine=False) is True
    assert ActorConfig().resolved_shared_prefix(transformer_engine=True) is False
    assert ActorConfig(shared_prefix=False).resolved_shared_prefix(transformer_engine=False) is False
    with pytest.raises(ValueError, match="local layer spec"):
        ActorConfig(shared_prefix=True).resolved_shared_prefix(transformer_engine=True)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from megatron_dapo.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("m")
    return {family: save_tiny_model(root / family, family, seed=5, vocab_size=200, max_position_embeddings=64)
            for family in ("qwen2", "qwen3_moe")}


def run(model_dir: Path, out: Path, tp: int, pp: int, env: dict) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    nproc = tp * pp
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(free_port()), str(WORKER), str(model_dir), str(out), str(tp), str(pp)]
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return [torch.load(out / f"rank_{i}.pt", weights_only=False) for i in range(nproc)]


@pytest.mark.parametrize("family, tp, pp", [("qwen2", 1, 1), ("qwen2", 2, 1), ("qwen2", 1, 2), ("qwen3_moe", 1, 1)],
                         ids=["tp1", "tp2", "pp2", "moe"])
def test_shared_prefix_equals_per_row(model_dirs, tmp_path, python_env, family, tp, pp):
    ranks = run(model_dirs[family], tmp_path, tp, pp, python_env)
    for rank in ranks:
        for case in CASES:
            off, on = rank[case]["off"], rank[case]["on"]
            assert (off["shared"], on["shared"]) == (False, True)
            lengths = rank[case]["lengths"]
            valid = torch.arange(off["logprobs"].shape[1])[None, :] < lengths[:, None]
            for key in ("logprobs", "entropy"):  # pi_old
                assert (on[key] - off[key])[valid].abs().max() < 2e-6, (case, key)
            check_responses_only(rank[case]["response_mask"] > 0, off, on, case)
            # the loss is a mean of advantage-weighted ratios of those logprobs: it inherits their 2e-6 (SDPA's
            # blocks over a packed sequence round differently from those over a row)
            for key in ("loss", "tokens", "clipfrac_high", "clipfrac_low", "entropy", "approx_kl", "grad_norm"):
                assert on["metrics"][key] == pytest.approx(off["metrics"][key], rel=1e-5, abs=1e-6), (case, key)
            assert on["grads"].keys() == off["grads"].keys()
            for name, g in off["grads"].items():
                check_grad(on["grads"][name], g, moe=family.endswith("moe"), what=f"{case} {name}")
            linear = CASES[case][0] == "linear"
            check_token_monitors(off["metrics"], on["metrics"], int(lengths.sum()), linear=linear)
            check_packed_rows(off, rank[case]["padded"], valid, family.endswith("moe"), case)
            if "dense" in rank[case]:
                check_dense_mask(on, rank[case]["dense"], valid, family.endswith("moe"))


def check_packed_rows(thd: dict, padded: dict, valid: torch.Tensor, moe: bool, case: str) -> None:
    """Rows packed into one sequence (Megatron's thd format, per-sequence causal SDPA) against the same rows
    right-padded: the same statistics, losses and gradients, and no padding computed."""
    for key in ("logprobs", "entropy"):
        assert (thd[key] - padded[key])[valid].abs().max() < 2e-6, (case, key)
    for key in ("loss", "tokens", "clipfrac_high", "clipfrac_low", "entropy", "approx_kl", "grad_norm"):
        assert thd["metrics"][key] == pytest.approx(padded["metrics"][key], rel=1e-5, abs=1e-6), (case, key)
    for name, g in padded["grads"].items():
        check_grad(thd["grads"][name], g, moe=moe, what=f"{case} thd {name}")
    assert thd["metrics"]["perf/pad_frac"] == 0.0 < padded["metrics"]["perf/pad_frac"]
    assert thd["metrics"]["perf/trained_tokens"] < padded["metrics"]["perf/trained_tokens"]


def check_responses_only(generated: torch.Tensor, off: dict, on: dict, case: str) -> None:
    """compute_logprobs(responses_only=True) (pi_old's: the output layer skips the prompt): every position's
    statistics at the generated tokens, 0 at the others."""
    assert generated.any() and not generated.all()
    for got in (off, on):
        for k, key in enumerate(("logprobs", "entropy")):
            resp = got["responses"][k]
            assert (resp - got[key])[generated].abs().max() < 2e-6, (case, key)
            assert not resp[~generated].any(), (case, key)


def check_dense_mask(on: dict, dense: dict, valid: torch.Tensor, moe: bool) -> None:
    """Shared prefix with Megatron's attention (the dense block mask, units in sequences as long as the
    longest) against SDPA's (its blocks, a micro-batch's units in one sequence): the same function."""
    assert dense["shared"] and dense["metrics"]["perf/pad_frac"] > 0.0 == on["metrics"]["perf/pad_frac"]
    assert (dense["logprobs"] - on["logprobs"])[valid].abs().max() < 2e-6
    assert dense["metrics"]["loss"] == pytest.approx(on["metrics"]["loss"], rel=1e-5, abs=1e-6)
    for name, g in on["grads"].items():
        check_grad(dense["grads"][name], g, moe=moe, what=f"dense {name}")


def check_grad(got: torch.Tensor, want: torch.Tensor, *, moe: bool, what: str) -> None:
    """Dense: elementwise, to within fp32 rounding of the gradient's scale. MoE: relative to the norm, since
    the per-row path's own fp32 noise (different micro-batch sizes: expert matmuls over other token counts)
    is up to 1.4e-4 of it in GSPO's update."""
    if moe:
        assert (got - want).norm() <= 5e-4 * want.norm(), what
    else:
        # atol scaled to the gradient: an embedding row sums many tokens' terms in another order (GSPO's
        # sequence ratio amplifies them): 9.4e-6 apart at an entry of 0.074 on an AMD Zen MKL
        scale = 2e-6 + 5e-5 * float(want.abs().max())
        torch.testing.assert_close(got, want, atol=scale, rtol=1e-4, msg=lambda m: f"{what}: {m}")


def check_token_monitors(off: dict, on: dict, row_tokens: int, linear: bool) -> None:
    def real(m: dict) -> float:
        return m["perf/trained_tokens"] * (1 - m["perf/pad_frac"])

    assert off["perf/prefix_saved_frac"] == 0.0 and off["perf/pad_frac"] == 0.0  # rows packed (thd)
    assert real(off) == pytest.approx(row_tokens)
    assert on["perf/trained_tokens"] < off["perf/trained_tokens"]
    assert real(on) == pytest.approx(row_tokens * (1 - on["perf/prefix_saved_frac"]))
    assert on["perf/prefix_saved_frac"] > 0.3
    assert on["perf/pad_frac"] == 0.0  # SDPA: a micro-batch's units in one sequence, its mask as blocks
    if linear:  # the output layer computes the loss tokens only (fewer when shared: common first response tokens)
        assert 0 < on["perf/output_tokens"] <= off["perf/output_tokens"] < real(off)
    else:
        for m in (off, on):
            assert m["perf/output_tokens"] == m["perf/trained_tokens"]


def test_on_with_transformer_engine_is_a_config_error():
    from megatron_dapo.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="shared_prefix=on needs model.transformer_impl=local"):
        load_config(None, ["actor.shared_prefix=on", "model.transformer_impl=transformer_engine"])
    assert load_config(None, ["actor.shared_prefix=off"]).actor.shared_prefix is False
