"""Evaluation: pass@k against enumerating every subset, maj@k by hand, and
`python -m megatron_dapo.evaluate` on an HF folder and on a Megatron checkpoint, equal to the trainer's
own validation (the same code) and to each other; sampled responses land in samples/step_<k>.jsonl.
The progress bar moves as each prompt's samples finish (streamed), with tokens/s, and
--n / --max-prompts / --max-response-len size the evaluation, with CPU-sized defaults."""

import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dapo.loop.evaluation import EvalResult, majority, pass_at_k, pass_ks
from megatron_dapo.metrics import read_texts
from megatron_dapo.types import Group, Prompt, Sample

REPO = Path(__file__).resolve().parents[1]
SMALL = ["train.prompt_batch_size=8", "train.mini_batch_size=4", "algo.group_size=4", "train.deterministic=true",
         "algo.filter_metric=score"]
VAL = "builtin:arithmetic?n=12&seed=77"
WORKERS = Path(__file__).parent / "workers"
# a user reward (tests/workers/length_reward.py): accuracy that does not need a base that can add
REWARD = "reward.name=length_reward:even_length"


def brute_pass(correct: list[bool], k: int) -> float:
    subsets = list(itertools.combinations(range(len(correct)), k))
    return sum(any(correct[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_is_the_chance_that_k_of_n_hold_a_correct_one(n):
    for c in range(n + 1):
        correct = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            assert math.isclose(pass_at_k(n, c, k), brute_pass(correct, k), abs_tol=1e-12), (n, c, k)
        assert pass_at_k(n, c, 1) == c / n  # pass@1 = accuracy


def test_pass_at_k_rejects_impossible_counts():
    for n, c, k in [(4, 5, 1), (4, 2, 0), (4, 2, 5), (4, -1, 1)]:
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)


def test_reported_k():
    assert pass_ks(32) == [1, 2, 4, 8, 16, 32]
    assert pass_ks(6) == [1, 2, 4, 6] and pass_ks(1) == [1] and pass_ks(2) == [1, 2]


def sample(pred, acc, length=3, reason="stop"):
    return Sample(prompt_ids=[1], response_ids=[2] * length, rollout_logprobs=[0.0] * length, finish_reason=reason,
                  response_text=f"Answer: {pred}", reward=1.0 if acc else -1.0, acc=acc, pred=pred)


def test_majority_vote():
    assert majority([sample("3", False), sample("4", True), sample("3", False)]) == ("3", False)
    assert majority([sample("4", True), sample("3", False)]) == ("4", True)  # a tie: the first seen wins
    assert majority([sample(None, False), sample(None, False), sample("7", True)]) == ("7", True)  # no vote
    assert majority([sample(None, False)]) == (None, False)


def test_eval_result_by_hand():
    p = [Prompt(uid=f"t/{i}", messages=({"role": "user", "content": f"q{i}"},), ground_truth="4") for i in range(2)]
    groups = [Group(p[0], [sample("4", True), sample("5", False), sample("5", False), sample("4", True, 9, "length")]),
              Group(p[1], [sample("1", False), sample(None, False), sample("4", True), sample("1", False)])]
    s = EvalResult(groups, 4).summary()
    assert s["avg@4"] == 3 / 8 and s["pass@1"] == 3 / 8
    assert math.isclose(s["pass@2"], (1 - 1 / 6 + 1 - 3 / 6) / 2)  # C(2,2)/C(4,2) and C(3,2)/C(4,2) miss
    assert s["pass@4"] == 1.0
    assert s["maj@4"] == 0.5  # "4" vs "5" tie -> "4" (first seen, right); "1" wins the second (wrong)
    assert s["response_length_mean"] == (3 * 7 + 9) / 8 and s["truncated_frac"] == 1 / 8
    rows = EvalResult(groups, 4).prompt_records()
    assert [r["correct"] for r in rows] == [2, 1] and rows[0]["maj_pred"] == "4" and rows[1]["maj_correct"] is False
    assert rows[0]["prompt"] == "q0" and len(rows[0]["responses"]) == 4 and rows[0]["pass@4"] == 1.0


# ------------------------------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def trained(base_dir, tmp_path_factory, python_env_module):
    """One DAPO step with validation before and after, samples every step, a checkpoint."""
    root = tmp_path_factory.mktemp("run")
    cmd = [sys.executable, "-m", "megatron_dapo.train", "--config", str(REPO / "examples/configs/tiny_cpu.yaml"),
           f"model.hf_dir={base_dir}", f"checkpoint.dir={root / 'ckpt'}", f"logging.tensorboard_dir={root / 'tb'}",
           "logging.run_name=ev", "train.steps=1", "eval.every_steps=1", "eval.n_samples=4",
           f"data.val_path={VAL}", "logging.samples_every=1", "logging.samples_per_step=6", REWARD, *SMALL]
    r = subprocess.run(cmd, capture_output=True, text=True, env=python_env_module, timeout=600)
    assert r.returncode == 0, r.stderr[-6000:]
    return root, r.stderr


@pytest.fixture(scope="module")
def python_env_module(env):
    """conftest's `env` with the test workers importable too."""
    return {**env, "PYTHONPATH": f"{WORKERS}{os.pathsep}{env['PYTHONPATH']}"}


def evaluate_cli(model, out, env, *extra):
    cmd = [sys.executable, "-m", "megatron_dapo.evaluate", "--model", str(model), "--data", VAL, "--n", "4",
           "--max-response-len", "24", "--temperature", "1.0", "--top-p", "0.7", "--out", str(out), REWARD, *extra]
    # (flags given twice: the last wins)
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-6000:]
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1, r.stdout  # one JSON summary line, nothing else
    return json.loads(lines[0]), [json.loads(x) for x in out.read_text().splitlines()]


def test_cli_equals_the_trainers_validation(base_dir, trained, tmp_path, python_env_module):
    from megatron_dapo.metrics import read_scalars

    root, _ = trained
    tb = read_scalars(root / "tb" / "ev")
    summary, rows = evaluate_cli(base_dir, tmp_path / "base.jsonl", python_env_module)
    assert summary["prompts"] == 12 and summary["samples"] == 48
    assert math.isclose(summary["avg@4"], tb["val/acc_avg_at_k"][0], abs_tol=1e-6)
    assert math.isclose(summary["pass@4"], tb["val/pass_at_k"][0], abs_tol=1e-6)
    assert math.isclose(summary["maj@4"], tb["val/maj_at_k"][0], abs_tol=1e-6)
    assert math.isclose(summary["response_length_mean"], tb["val/response_length_mean"][0], abs_tol=1e-4)
    assert tb["reward/failures"][1] == 0
    assert math.isclose(sum(r["correct"] for r in rows) / 48, summary["avg@4"])
    assert math.isclose(sum(r["maj_correct"] for r in rows) / 12, summary["maj@4"])
    assert tb["timing/eval_s"][0] > 0 and set(tb["timing/eval_s"]) == {0, 1}


def test_cli_on_a_megatron_checkpoint_equals_its_hf_export(trained, tmp_path, python_env_module):
    root, _ = trained
    run = root / "ckpt" / "ev"
    from_ckpt, rows_ckpt = evaluate_cli(run, tmp_path / "ckpt.jsonl", python_env_module)  # newest step_<N>/
    from_hf, rows_hf = evaluate_cli(run / "hf_final", tmp_path / "hf.jsonl", python_env_module)
    metrics = [k for k in from_hf if k.startswith(("avg@", "pass@", "maj@", "response_length"))]
    assert {k: from_ckpt[k] for k in metrics} == {k: from_hf[k] for k in metrics}
    assert rows_ckpt == rows_hf
    newest = max(p for p in run.glob("step_*") if (p / "COMPLETE").is_file())
    assert Path(from_ckpt["evaluated"]) == newest and Path(from_hf["evaluated"]) == run / "hf_final"


def test_samples_are_written_for_people_to_read(trained):
    root, _ = trained
    folder = root / "tb" / "ev" / "samples"
    step0 = [json.loads(x) for x in (folder / "step_0.jsonl").read_text().splitlines()]
    step1 = [json.loads(x) for x in (folder / "step_1.jsonl").read_text().splitlines()]
    assert {r["split"] for r in step0} == {"val"} and len(step0) == 6
    assert [r["split"] for r in step1] == ["train"] * 6 + ["val"] * 6
    for r in step0 + step1:
        assert set(r) >= {"prompt", "response", "reward", "acc", "length", "ground_truth", "uid"}
        assert r["prompt"].endswith("=") and isinstance(r["acc"], bool) and r["length"] <= 24
    texts = read_texts(root / "tb" / "ev")  # the first records also as TensorBoard text
    assert set(texts["samples/val"]) == {0, 1} and set(texts["samples/train"]) == {1}
    assert step0[0]["prompt"] in texts["samples/val"][0] and step1[0]["prompt"] in texts["samples/train"][1]


def test_progress_advances_group_by_group_as_they_finish(base_dir):
    """The progress callback sees every prompt once, as soon as its k samples are done: all rows run
    at once here, so a group finishes with its longest sample and the callbacks come shortest first, the
    first long before the last. The result is in prompt order, and seeded per prompt."""
    from transformers import AutoTokenizer

    from megatron_dapo.config import RewardConfig
    from megatron_dapo.data import load_prompts
    from megatron_dapo.loop.evaluation import generate_and_score
    from megatron_dapo.reward import Scorer
    from megatron_dapo.rollout.base import SamplingParams
    from megatron_dapo.rollout.embedded import EmbeddedEngine

    tok = AutoTokenizer.from_pretrained(base_dir)
    prompts = load_prompts(VAL).prompts
    scorer = Scorer(RewardConfig(soft_overlong_punishment=False), max_response_len=24)
    seen = []

    def sampling(i):
        return SamplingParams(max_new_tokens=24, stop_token_ids=(tok.eos_token_id,), seed=1000 + i)

    def record(g):
        seen.append((g.prompt.uid, max(s.response_len for s in g.samples),
                     all(s.response_text is not None for s in g.samples)))

    with EmbeddedEngine(base_dir) as engine:
        groups = generate_and_score(engine, tok, prompts, 4, sampling, scorer, on_group=record)
        again = generate_and_score(engine, tok, prompts[::-1], 4, lambda i: sampling(len(prompts) - 1 - i),
                                   scorer)
    assert [g.prompt.uid for g in groups] == [p.uid for p in prompts]
    assert sorted(uid for uid, _, _ in seen) == sorted(p.uid for p in prompts)  # once each
    longest = [n for _, n, _ in seen]
    assert longest == sorted(longest) and longest[0] < longest[-1], longest
    assert all(scored for _, _, scored in seen)  # scored before it is reported
    assert [[s.response_ids for s in g.samples] for g in again[::-1]] == [[s.response_ids for s in g.samples]
                                                                           for g in groups]


def test_cli_flags_size_the_evaluation_and_the_bar_moves_per_prompt(base_dir, tmp_path, python_env_module):
    out = tmp_path / "small.jsonl"
    flags = ["--n", "2", "--max-prompts", "5", "--max-response-len", "8"]
    r = subprocess.run([sys.executable, "-m", "megatron_dapo.evaluate", "--model", str(base_dir), "--data", VAL,
                        *flags, "--out", str(out), REWARD], capture_output=True, text=True, env=python_env_module,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-6000:]
    summary = json.loads(r.stdout)
    assert (summary["prompts"], summary["samples"], summary["n"], summary["max_response_len"]) == (5, 10, 2, 8)
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 5 and all(len(row["responses"]) == 2 for row in rows)
    assert max(x["length"] for row in rows for x in row["responses"]) <= 8
    assert "5 prompts x 2 samples, responses up to 8 tokens" in r.stderr
    bar = r.stderr.replace("\r", "\n").splitlines()
    for k in range(1, 6):
        assert any(f"| {k}/5 [" in line and "tok/s]" in line for line in bar), (k, bar)


def test_cpu_defaults_apply_where_nothing_sizes_the_evaluation():
    from megatron_dapo.evaluate import CPU_DEFAULTS, build_parser, resolve_config

    def sized(*argv, on_gpu=False):
        cfg = resolve_config(build_parser().parse_intermixed_args(["--model", "m", "--data", VAL, *argv]),
                             on_gpu=on_gpu)
        return cfg.eval.n_samples, cfg.eval.max_prompts, cfg.rollout.max_response_len

    assert sized() == (4, 32, 256) == tuple(CPU_DEFAULTS.values())
    assert sized(on_gpu=True) == (32, None, 20480)  # the paper's, from the config
    assert sized("--config", str(REPO / "examples/configs/tiny_cpu.yaml")) == (4, 256, 24)  # the config's own
    assert sized("eval.n_samples=8", "rollout.max_response_len=64") == (8, 32, 64)
    assert sized("--n", "2", "--max-prompts", "5", "--max-response-len", "8", "eval.n_samples=8") == (2, 5, 8)
    help_text = " ".join(build_parser().format_help().split())
    assert "else 4 on CPU, 32 on GPU" in help_text and "else 256 on CPU, 20480 on GPU" in help_text
    assert "else 32 on CPU, all on GPU" in help_text


def test_default_out_names_the_run_and_the_step(tmp_path):
    """Each run's hf_final, and each step, its own file: they no longer overwrite each other."""
    from megatron_dapo.evaluate import default_out

    run = tmp_path / "checkpoints" / "tiny_cpu"
    assert default_out(run / "hf_final") == Path("runs/eval/tiny_cpu-hf_final.jsonl")
    assert default_out(run / "step_00000040") == Path("runs/eval/tiny_cpu-step_00000040.jsonl")
    assert default_out(tmp_path / "other" / "hf_final") == Path("runs/eval/other-hf_final.jsonl")
    assert default_out(tmp_path / "checkpoints" / "tiny_base") == Path("runs/eval/tiny_base.jsonl")


def test_model_errors_name_the_model_flag(tmp_path):
    from megatron_dapo.cli import UserError
    from megatron_dapo.evaluate import hf_model

    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError) as e, hf_model(tmp_path / "empty"):
        pass
    assert str(e.value).startswith("--model ") and "--load" not in str(e.value), e.value


def test_cli_bad_input_is_one_line(tmp_path, python_env_module):
    r = subprocess.run([sys.executable, "-m", "megatron_dapo.evaluate", "--model", str(tmp_path / "nope"),
                        "--data", VAL], capture_output=True, text=True, env=python_env_module, timeout=120)
    assert r.returncode == 2 and "no such folder" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.sglang
def test_cli_on_sglang_equals_embedded_when_greedy(base_dir, tmp_path, python_env_module, sglang_python):
    """--engine sglang: a real SGLang server on CPU; greedy decoding (temperature 0) gives the embedded
    engine's responses, so every metric is equal."""
    from sglang_support import server_ports

    env = {**python_env_module, "MEGATRON_DAPO_SGLANG_PYTHON": sglang_python}
    greedy = ["--temperature", "0", "--n", "2"]
    embedded, rows_e = evaluate_cli(base_dir, tmp_path / "e.jsonl", env, *greedy)
    served, rows_s = evaluate_cli(base_dir, tmp_path / "s.jsonl", env, *greedy, "--engine", "sglang",
                                  f"rollout.sglang.base_port={server_ports()}")
    metrics = [k for k in embedded if k.startswith(("avg@", "pass@", "maj@", "response_length"))]
    assert {k: served[k] for k in metrics} == {k: embedded[k] for k in metrics}
    assert [r["responses"] for r in rows_s] == [r["responses"] for r in rows_e]
