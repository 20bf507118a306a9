"""Routing replay on the actor (actor.routing_replay=r2; actor/routing.py), one rank, a tiny Qwen3-MoE in fp32.

Independent reference: transformers, its routers either free (the experts the pi_old pass must record) or forced
to given experts (the probabilities renormalised over them, as its router does over its own top-k): the actor's
update replaying those routes sees the policy transformers computes with them, so its ratio is exactly 1."""

from typing import Literal

import pytest
import torch

from megatron_dapo import parallel
from megatron_dapo.actor.batching import MicroBatch, micro_batches
from megatron_dapo.actor.routing import routes_to_model, routes_to_rows
from megatron_dapo.config import Config
from megatron_dapo.tiny import tiny_model
from megatron_dapo.types import TrainBatch

VOCAB, EXPERTS, TOP_K, LAYERS = 200, 8, 2, 2


@pytest.fixture(scope="module")
def one_rank():
    parallel.initialize(Config().parallel, seed=1)
    yield
    parallel.destroy()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("moe")
    model = tiny_model("qwen3_moe", seed=5, vocab_size=VOCAB, max_position_embeddings=128, eos_token_id=VOCAB - 1,
                       num_experts=EXPERTS, num_experts_per_tok=TOP_K, head_dim=24)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(8.0)  # clear top-k margins: fp32 noise cannot flip a choice
    model.save_pretrained(folder)
    return folder


def _batch() -> TrainBatch:
    g = torch.Generator().manual_seed(4)
    lengths = torch.tensor([14, 9, 11, 6])
    ids = torch.randint(0, VOCAB - 1, (4, 14), generator=g)
    mask = torch.zeros(4, 14)
    for i, n in enumerate(lengths.tolist()):
        ids[i, n:] = 0
        mask[i, 3:n] = 1.0
    return TrainBatch(input_ids=ids, loss_mask=mask, advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]),
                      lengths=lengths)


def _hf_pass(hf_dir, batch: TrainBatch, forced: torch.Tensor | None = None):
    """(logprobs [B, S] with position 0 = 0, routes [B, S, layers, k]) of transformers, row by row; `forced`
    [B, S, layers, k]: the experts each router must take."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    lp = torch.zeros(batch.input_ids.shape)
    routes = torch.zeros(*batch.input_ids.shape, LAYERS, TOP_K, dtype=torch.long)
    for i, n in enumerate(batch.lengths.tolist()):
        seen: list[torch.Tensor] = []
        for layer, block in enumerate(hf.model.layers):
            gate = block.mlp.gate

            def forward(h, gate=gate, layer=layer):
                logits = torch.nn.functional.linear(h, gate.weight)
                probs = torch.softmax(logits, -1, dtype=torch.float)
                idx = probs.topk(TOP_K, -1).indices if forced is None else forced[i, :n, layer].long()
                top = probs.gather(-1, idx)
                seen.append(idx.sort(-1).values)
                return logits, (top / top.sum(-1, keepdim=True)).to(logits.dtype), idx

            gate.forward = forward
        with torch.no_grad():
            logits = hf(batch.input_ids[i : i + 1, :n]).logits[0]
        lp[i, 1:n] = torch.log_softmax(logits[:-1], -1).gather(-1, batch.input_ids[i, 1:n, None]).squeeze(-1)
        routes[i, :n] = torch.stack(seen, 1)
    return lp, routes


def _random_routes(batch: TrainBatch) -> torch.Tensor:
    """[B, S, layers, k]: k distinct experts per (token, layer), seeded, mostly not the routers' own."""
    n = batch.input_ids.numel() * LAYERS
    picks = [torch.randperm(EXPERTS, generator=torch.Generator().manual_seed(t))[:TOP_K] for t in range(n)]
    return torch.stack(picks).view(*batch.input_ids.shape, LAYERS, TOP_K)


def _actor(hf_dir, replay: Literal["none", "r2", "r3"]):
    from megatron_dapo.actor.actor import Actor

    cfg = Config()
    cfg.actor.routing_replay = replay
    cfg.actor.micro_batch_tokens, cfg.actor.logprob_micro_batch_tokens = 24, 16  # other packings in the 2 passes
    cfg.actor.optimizer.lr = 1e-3
    return Actor.from_hf(str(hf_dir), cfg.model, cfg.parallel, cfg.actor)


def test_routes_map_between_rows_and_the_models_token_order():
    """Megatron's [sequence, batch] token order, the padded and the thd layouts: rows -> model -> rows is the
    identity on every row's tokens, and positions that are no row's token get experts 0..k-1."""
    batch = _batch()
    routes = torch.randint(0, EXPERTS, (*batch.input_ids.shape, LAYERS, TOP_K), dtype=torch.uint8)
    batch.routes = routes
    for thd in (0, 1):
        for mb in micro_batches(batch, 24, thd=thd):
            model, real = routes_to_model(mb, mb.routes)
            assert int(real.sum()) == int(mb.lengths.sum()) - len(mb.lengths)  # every token's but a row's last
            assert model.shape == (mb.model_shape[0] * mb.model_shape[1], LAYERS, TOP_K)
            back = routes_to_rows(mb, model)
            for j, n in enumerate(mb.lengths.tolist()):
                assert torch.equal(back[j, :n], routes[int(mb.rows[j]), :n])
    whole: MicroBatch = micro_batches(batch, 100, thd=0)[0]  # one padded [4, 14] batch: row 3 is 6 long
    assert whole.routes is not None
    flat, real = routes_to_model(whole, whole.routes)
    model = flat.view(14, 4, LAYERS, TOP_K)  # [s, b]
    assert real.view(14, 4)[:, 3].tolist() == [True] * 5 + [False] * 9  # its last token replayed, not counted
    assert torch.equal(model[2, 1], routes[int(whole.rows[1]), 2])
    assert torch.equal(model[10, 3], torch.arange(TOP_K, dtype=torch.uint8).expand(LAYERS, TOP_K))


@pytest.mark.usefixtures("one_rank")
def test_r2_records_transformers_routes_and_the_update_replays_given_ones_exactly(hf_dir):
    actor = _actor(hf_dir, "r2")
    batch = _batch()
    lp, _ = actor.compute_logprobs(batch, record_routes=True)
    hf_lp, hf_routes = _hf_pass(hf_dir, batch)
    for i, n in enumerate(batch.lengths.tolist()):  # the experts transformers' routers pick, every token
        assert torch.equal(batch.routes[i, :n].long().sort(-1).values, hf_routes[i, :n])
    assert torch.allclose(lp, hf_lp, atol=1e-5)

    # other experts than the router's own: the update replays them, so it computes transformers' forced policy
    forced = _random_routes(batch)
    forced_lp, _ = _hf_pass(hf_dir, batch, forced)
    assert (forced_lp - hf_lp).abs().max() > 1e-2  # the forced routes change the policy
    batch.routes, batch.old_logprobs = forced.to(torch.uint8), forced_lp
    m = actor.train_step(batch)
    assert m["approx_kl"] < 1e-10 and m["clipfrac_high"] == m["clipfrac_low"] == 0.0  # ratio 1: pi_theta = pi_old
    tokens = batch.loss_mask.sum()
    assert m["loss"] == pytest.approx(-(batch.advantages[:, None] * batch.loss_mask).sum().item() / tokens.item(),
                                      abs=1e-6)
    assert m["moe/routing_agreement"] < 0.5  # its own router would have picked mostly others
    assert m["moe/expert_load_max_over_mean"] >= 1.0


@pytest.mark.usefixtures("one_rank")
def test_without_replay_the_update_routes_by_itself_and_counts_agreement(hf_dir):
    """replay none: the update routes by itself (ratio != 1 against a forced pi_old) and only compares; against
    the routes its own pi_old pass recorded (other packings, same weights) it agrees on every token."""
    actor = _actor(hf_dir, "none")
    batch = _batch()
    batch.old_logprobs, _ = actor.compute_logprobs(batch, record_routes=True)
    assert actor.train_step(batch)["moe/routing_agreement"] == 1.0
    forced = torch.zeros(*batch.input_ids.shape, LAYERS, TOP_K, dtype=torch.long)
    forced[..., 1] = 1  # experts 0 and 1 for every token
    batch.old_logprobs, _ = _hf_pass(hf_dir, batch, forced)
    batch.routes = forced.to(torch.uint8)
    m = actor.train_step(batch)
    assert m["approx_kl"] > 1e-6 and m["moe/routing_agreement"] < 0.5  # replayed: approx_kl < 1e-10


@pytest.mark.usefixtures("one_rank")
def test_r2_replays_exactly_in_a_shared_prefix_layout(hf_dir):
    """A group's rows share their prompt (actor.shared_prefix): each row's own copy of the prompt's last token
    (its segment's start, which no statistic reads) replays that token's experts too. Before, it took experts
    0..k-1 and moved its segment's tokens: the first r2 update's ratio was not 1 (approx_kl 0.015, agreement
    0.994 on the tiny MoE base)."""
    actor = _actor(hf_dir, "r2")
    assert actor.shared_prefix
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, VOCAB - 1, (7,), generator=g)
    rows = [torch.cat([prompt, torch.randint(0, VOCAB - 1, (n,), generator=g)]) for n in (3, 6, 4, 5)]
    ids = torch.zeros(4, 13, dtype=torch.long)
    mask = torch.zeros(4, 13)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, 7 : len(r)] = r, 1.0
    batch = TrainBatch(input_ids=ids, loss_mask=mask, advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]),
                       lengths=torch.tensor([len(r) for r in rows]), prompt_index=torch.zeros(4, dtype=torch.long),
                       response_mask=mask.clone())
    batch.old_logprobs, _ = actor.compute_logprobs(batch, responses_only=True, record_routes=True)
    m = actor.train_step(batch)
    assert m["approx_kl"] < 1e-10 and m["moe/routing_agreement"] == 1.0, m


@pytest.mark.usefixtures("one_rank")
def test_r3_replays_the_rollouts_routes_in_pi_old_and_the_update(hf_dir):
    """The embedded engine's samples carry their routes (every token it read); the batch built from them holds them
    per row; the r3 actor's pi_old pass replays them: on the same fp32 weights it computes the rollout's logprobs and
    its own routers agree everywhere. Routes other than the routers' own are replayed as given: pi_old is
    transformers' forced policy, and the update's ratio against it is 1."""
    from megatron_dapo.algo.train_batch import build_train_batch
    from megatron_dapo.rollout.base import SamplingParams
    from megatron_dapo.rollout.embedded.engine import EmbeddedEngine
    from megatron_dapo.types import Group, Prompt

    engine = EmbeddedEngine(str(hf_dir))
    prompts = [[3, 5, 7, 9, 11], [4, 8, 15], [16, 23, 42, 2, 1, 6]]
    out = engine.generate(prompts, 2, SamplingParams(max_new_tokens=8, seed=2, return_routes=True))
    groups = [Group(Prompt(uid=str(i), messages=(), ground_truth=""), g) for i, g in enumerate(out)]
    batch = build_train_batch(groups, torch.tensor([1.0, -1.0, 0.5, -0.5, 0.25, -0.25]))
    assert batch.routes is not None and batch.routes.shape[2:] == (LAYERS, TOP_K)
    actor = _actor(hf_dir, "r3")
    lp, _ = actor.compute_logprobs(batch, responses_only=True, record_routes=True)
    assert torch.allclose(lp, batch.rollout_logprobs, atol=1e-5)
    assert actor.routing_scalars()["moe/rollout_routing_agreement"] == 1.0

    forced = _random_routes(batch)
    for i, p in enumerate(batch.prompt_index.tolist()):  # a group's rows read its prompt in one prefill: one route
        forced[i, : len(prompts[p])] = forced[2 * p, : len(prompts[p])]
    forced_lp, _ = _hf_pass(hf_dir, batch, forced)
    batch.routes = forced.to(torch.uint8)
    valid = torch.arange(batch.input_ids.shape[1])[None, 1:] < batch.lengths[:, None]
    lp, _ = actor.compute_logprobs(batch, record_routes=True)
    assert torch.allclose(lp[:, 1:][valid], forced_lp[:, 1:][valid], atol=1e-5)
    assert (forced_lp[:, 1:][valid] - batch.rollout_logprobs[:, 1:][valid]).abs().max() > 1e-2
    batch.old_logprobs = forced_lp
    m = actor.train_step(batch)
    assert m["approx_kl"] < 1e-10 and m["clipfrac_high"] == m["clipfrac_low"] == 0.0


def test_r2_is_refused_on_a_dense_model(tmp_path):
    from megatron_dapo.actor.actor import Actor
    from megatron_dapo.actor.model import spec_from_hf

    spec = spec_from_hf(tiny_model("qwen3", seed=1, vocab_size=VOCAB, head_dim=24).config)
    cfg = Config()
    cfg.actor.routing_replay = "r2"
    with pytest.raises(ValueError, match="routing_replay=r2 needs a MoE model"):
        Actor(spec, cfg.model, cfg.parallel, cfg.actor)


LAYOUTS = {"ep2": (1, 1, 2), "pp2": (1, 2, 1), "tp2": (2, 1, 1)}
"""(tp, pp, ep); "tp2" is (2, 1, 1) with sequence parallelism, which Megatron needs for a MoE model at TP > 1: each TP
rank routes its slice of the sequence (RouteKeeper slices the routes and gathers what it records)."""


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_replay_is_exact_at_ep2_pp2_and_tp2(hf_dir, tmp_path, env, layout):
    """Each layout's update replays the forced routes (its TP slice of the tokens, its DP rows, its stage's layers):
    ratio 1 against transformers' forced policy on every rank, the loss the advantages alone give. r2 (this stage's
    layers of the routes) and r3 (every layer's, as a rollout returns them: the pi_old pass replays them too and
    computes that forced policy), one after the other in one launch."""
    from pathlib import Path

    from support import launch_plan

    batch = _batch()
    forced = _random_routes(batch)
    batch.old_logprobs, _ = _hf_pass(hf_dir, batch, forced)
    batch.routes = forced.to(torch.uint8)
    torch.save(batch, tmp_path / "batch.pt")
    tp, pp, ep = LAYOUTS[layout]
    worker = Path(__file__).parent / "workers" / "moe_worker.py"
    entry = {"case": "replay", "hf_dirs": [str(hf_dir)], "out": tmp_path / "out", "tp": tp, "pp": pp, "ep": ep,
             "env": {"DAPO_TEST_SP": "1"} if tp > 1 else {}}
    ranks = launch_plan(worker, 2, [entry], {**env, "REPLAY_BATCH": str(tmp_path / "batch.pt")}, timeout=300)[0]
    loss = -(batch.advantages[:, None] * batch.loss_mask).sum().item() / batch.loss_mask.sum().item()
    valid = torch.arange(batch.input_ids.shape[1])[None, 1:] < batch.lengths[:, None]
    for rank in range(2):
        res = ranks[rank]["models"][hf_dir.name]
        assert torch.allclose(res["r3"]["old_logprobs"][:, 1:][valid], batch.old_logprobs[:, 1:][valid], atol=1e-5)
        for mode in ("r2", "r3"):
            m = res[mode]["metrics"]
            assert m["approx_kl"] < 1e-10 and m["clipfrac_high"] == m["clipfrac_low"] == 0.0, (layout, mode, m)
            assert m["loss"] == pytest.approx(loss, abs=1e-6)
            assert m["moe/routing_agreement"] < 0.5


def test_r3_is_refused_with_tools_and_taken_with_partial_rollout_and_the_pipelines():
    from megatron_dapo.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="actor.routing_replay=r3 does not work with rollout.tools"):
        load_config(None, ["actor.routing_replay=r3", "rollout.tools.name=python"])
    for ok in (["rollout.streaming=true", "rollout.partial_rollout=true"], ["rollout.async_steps=2", "rollout.colocate=false"],
               ["rollout.async_steps=1", "rollout.async_mode=stream", "rollout.streaming=true", "rollout.colocate=false"]):
        assert load_config(None, ["actor.routing_replay=r3", *ok]).actor.routing_replay == "r3"
