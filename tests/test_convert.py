"""tools/convert_hf_to_megatron.py and tools/convert_megatron_to_hf.py on tiny random models built with
transformers: a Qwen2 (qkv bias, untied lm_head) and a Llama (tied embeddings), vocab 300 so that the
padded vocab differs between TP1/PP2 (384) and TP2 (512).

Round trips HF -> Megatron -> HF must be bit-identical (tensors, dtypes, config.json, tokenizer files).
Megatron logits vs transformers <= 1e-4 (fp32): TP2 and PP2 through convert_hf_to_megatron --verify (the
tool spawns 2 gloo ranks and reloads what it wrote), TP1 through convert_megatron_to_hf --verify (reading
the TP2-written checkpoint), and TP2 through the actor's own load_checkpoint of the PP2-written one.
Bad inputs must fail with one clear line and exit code 2, never a traceback.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TOOLS = REPO / "tools"
WORKER = Path(__file__).parent / "workers" / "convert_worker.py"
TO_MEGATRON, TO_HF = TOOLS / "convert_hf_to_megatron.py", TOOLS / "convert_megatron_to_hf.py"
sys.path.insert(0, str(TOOLS))
import _convert_common as cc  # noqa: E402

TOKENIZER_FILES = {"tokenizer.json": '{"version": "1.0", "model": {"type": "BPE"}}\n',
                   "tokenizer_config.json": '{"model_max_length": 128}\n',
                   "special_tokens_map.json": '{"eos_token": "<|endoftext|>"}\n'}
VERIFY_LINE = re.compile(r"max \|logit diff\| = ([0-9.e+-]+) .*argmax agreement = ([0-9.]+) .*: (OK|FAILED)")


def _tiny(kind: str, folder: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0 if kind == "qwen2" else 1)
    common = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  rope_theta=50000.0)
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=False))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=True, rms_norm_eps=1e-5))
    with torch.no_grad():  # norms away from 1 so that a swapped or dropped norm shows in the logits
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    for name, text in TOKENIZER_FILES.items():
        (folder / name).write_text(text)
    return folder


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return _tiny("qwen2", tmp_path_factory.mktemp("qwen2"))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _tiny("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def env():
    import os

    e = dict(os.environ)
    e["PYTHONPATH"] = f"{REPO}{os.pathsep}{e.get('PYTHONPATH', '')}"
    e["OMP_NUM_THREADS"] = "1"
    return e


def tool(script: Path, *args, env, expect: int = 0, timeout: int = 300) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True, text=True,
                       env=env, timeout=timeout)
    assert r.returncode == expect, f"exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    assert "Traceback" not in r.stderr, r.stderr[-5000:]
    return r


def verified(r: subprocess.CompletedProcess) -> tuple[float, float]:
    m = VERIFY_LINE.search(r.stdout)
    assert m and m.group(3) == "OK", r.stdout
    return float(m.group(1)), float(m.group(2))


def hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from megatron_dapo.actor.hf_io import SafetensorsReader

    reader = SafetensorsReader(folder)
    return {n: reader.get(n) for n in reader.weight_map}


def assert_identical(src: Path, out: Path) -> None:
    a, b = hf_tensors(src), hf_tensors(out)
    assert a.keys() == b.keys()
    for name, t in a.items():
        assert b[name].dtype == t.dtype and torch.equal(b[name], t), name
    assert (out / "config.json").read_bytes() == (src / "config.json").read_bytes()
    for name in [*TOKENIZER_FILES, "generation_config.json"]:
        assert (out / name).read_bytes() == (src / name).read_bytes(), name


@pytest.fixture(scope="module")
def converted(qwen2, llama, tmp_path_factory, env):
    """qwen2 written at TP2, llama at PP2 (2 ranks each, spawned by the tool), both --verify."""
    root = tmp_path_factory.mktemp("converted")
    runs = {"qwen2": [TO_MEGATRON, "--hf-dir", qwen2, "--save", root / "qwen2", "--tp", 2, "--verify"],
            "llama": [TO_MEGATRON, "--hf-dir", llama, "--save", root / "llama", "--pp", 2, "--verify"]}
    procs = {k: subprocess.Popen([sys.executable, *map(str, cmd)], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=env)
             for k, cmd in runs.items()}  # both at once: 4 ranks, 2 cores, less idle time
    results = {}
    try:
        for name, p in procs.items():
            out, err = p.communicate(timeout=400)
            results[name] = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    for name, r in results.items():
        assert r.returncode == 0 and "Traceback" not in r.stderr, \
            f"{name}: exit {r.returncode}\n{r.stdout}\n{r.stderr[-5000:]}"
    return {"qwen2": root / "qwen2", "llama": root / "llama", "root": root, "runs": results}


def test_hf_to_megatron_verifies_at_tp2_and_pp2(converted):
    for name, r in converted["runs"].items():
        diff, agree = verified(r)
        assert diff <= 1e-4 and agree == 1.0, name
        summary = r"\d+ tensors, .* read, .* written, TP=\d PP=\d float32, [0-9.]+ s ->"
        assert re.search(summary, r.stdout), r.stdout
    for name, n_tensors in (("qwen2", 27), ("llama", 20)):
        ckpt = converted[name]
        assert (ckpt / "COMPLETE").is_file() and (ckpt / "hf" / "config.json").is_file()
        info = json.loads((ckpt / "conversion.json").read_text())
        assert info["hf_tensors"] == n_tensors and info["dtype"] == "float32"
        assert not ckpt.with_name(ckpt.name + ".partial").exists()


def test_qwen2_round_trip_sharded_output_is_bit_identical(converted, qwen2, env):
    """Back with neither --hf-dir nor layout flags (config and tokenizer come from the checkpoint), verified
    at TP1 although written at TP2; output sharded above 150 KB."""
    out = converted["root"] / "qwen2_hf"
    r = tool(TO_HF, "--load", converted["qwen2"], "--save", out, "--max-shard-size", "150KB", "--verify",
             env=env)
    diff, _ = verified(r)
    assert diff <= 1e-4
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) == 4 and not (out / "model.safetensors").exists()
    assert all((out / f).stat().st_size <= 150_000 + 1000 for f in files)
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in hf_tensors(qwen2).values())
    assert_identical(qwen2, out)
    assert re.search(r"27 tensors, .* in 4 safetensors file\(s\), float32", r.stdout), r.stdout


def _load_in_actor(ckpt: Path, out: Path, tp: int, pp: int, env, train_root: Path | None = None):
    from megatron_dapo.parallel import free_port

    out.mkdir(parents=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(tp * pp), "--master_port",
           str(free_port()), str(WORKER), str(ckpt), str(out), str(tp), str(pp)]
    if train_root is not None:
        cmd.append(str(train_root))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return [torch.load(p, weights_only=False) for p in sorted(out.glob("rank_*.pt"))]


@pytest.fixture(scope="module")
def actor_layouts(converted, env):
    """The actor loads llama (written at PP2) at TP2, then writes a training checkpoint of it (optimizer
    state, no hf/ copy) as the trainer would."""
    root = converted["root"]
    results = _load_in_actor(converted["llama"], root / "llama_actor", 2, 1, env, root / "llama_train")
    return {"llama": results, "train_root": root / "llama_train"}


def test_actor_loads_a_converted_checkpoint_at_another_layout(actor_layouts, llama):
    """Written at PP2 (vocab padded to 384), read by the actor at TP2 (512). (TP2 -> TP1 is covered by the
    qwen2 round trip: convert_megatron_to_hf --verify reads the TP2-written checkpoint at TP1.)"""
    ref = cc.hf_logits(llama, cc.verify_tokens(_spec(llama)))
    got = [r["logits"] for r in actor_layouts["llama"]]
    assert len(got) == 2 and all(r["padded_vocab"] == 512 for r in actor_layouts["llama"])
    for logits in got:
        diff, agree = cc.compare_logits(logits, ref)
        assert diff <= 1e-4 and agree == 1.0, diff


def test_llama_tied_round_trip_through_a_training_checkpoint(actor_layouts, converted, llama, capsys, env):
    """The actor's step_<N>/ folders (optimizer state, TP2 vocab padding, no hf/ copy) export with --hf-dir;
    training TP/PP flags are ignored with a note; a non-empty output needs --force, then is replaced."""
    train_root, out = actor_layouts["train_root"], converted["root"] / "llama_hf"
    code, err = run_in_process(TO_HF, "--load", train_root, "--save", out, capsys=capsys)
    assert code == 2 and "keeps no config.json" in err and "--hf-dir" in err, err
    out.mkdir()
    (out / "old.txt").write_text("keep me unless --force")
    code, err = run_in_process(TO_HF, "--load", train_root, "--save", out, "--hf-dir", llama, capsys=capsys)
    assert code == 2 and "is not empty: pass --force" in err and (out / "old.txt").is_file(), err
    r = tool(TO_HF, "--load", train_root, "--save", out, "--hf-dir", llama, "--force", "--tp", 2, "--pp", 1,
             env=env)
    assert "using the latest complete checkpoint" in r.stdout and "step_00000003" in r.stdout
    assert "ignoring --tp 2, --pp 1" in r.stderr
    assert not (out / "old.txt").exists() and (out / "model.safetensors").is_file()
    assert "lm_head.weight" not in hf_tensors(out)
    assert_identical(llama, out)


def _spec(hf_dir):
    from megatron_dapo.actor.model import load_hf_config, spec_from_hf

    return spec_from_hf(load_hf_config(hf_dir))


# --- bad inputs: one clear line, exit 2, no traceback, nothing written ------------------------------------


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_config_mismatch_is_named(qwen2, tmp_path, env):
    bad = _copy(qwen2, tmp_path / "bad")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["hidden_size"] = 128  # the tensors are 64 wide
    (bad / "config.json").write_text(json.dumps(cfg))
    r = tool(TO_MEGATRON, "--hf-dir", bad, "--save", tmp_path / "out", env=env, expect=2)
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("convert_hf_to_megatron: error: model.embed_tokens.weight: shape [300, 64]"), line
    assert "expected [300, 128]" in line and "hidden_size=128" in line
    assert not (tmp_path / "out").exists()


def test_truncated_safetensors_is_named(qwen2, tmp_path, env):
    bad = _copy(qwen2, tmp_path / "bad")
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    r = tool(TO_MEGATRON, "--hf-dir", bad, "--save", tmp_path / "out", "--tp", 2, env=env, expect=2)
    assert re.search(r"error: .*model\.safetensors: truncated: .* ends at byte \d+ .* holds only \d+",
                     r.stderr), r.stderr
    assert not (tmp_path / "out").exists()


def run_in_process(script: Path, *args, capsys) -> tuple[int, str]:
    """A tool's main() through its error handler, in this process (saves an interpreter start per check)."""
    import importlib.util

    mod = sys.modules.get(script.stem)
    if mod is None:
        spec = importlib.util.spec_from_file_location(script.stem, script)
        mod = sys.modules[script.stem] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    capsys.readouterr()
    code = cc.run_cli(mod.PROG, mod.main, [str(a) for a in args])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def test_layout_architecture_and_output_checks(qwen2, llama, converted, tmp_path, capsys):
    def fails(script, *args, says):
        code, err = run_in_process(script, *args, capsys=capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1 and says in err, err

    fails(TO_MEGATRON, "--hf-dir", qwen2, "--save", tmp_path / "o", "--tp", 3,
          says="num_attention_heads=4 is not divisible by tensor_parallel=3")
    fails(TO_MEGATRON, "--hf-dir", qwen2, "--save", qwen2, "--force", says="would overwrite the input")
    other = _copy(qwen2, tmp_path / "mistral")
    cfg = json.loads((other / "config.json").read_text())
    cfg.update(architectures=["MistralForCausalLM"], model_type="mistral")
    (other / "config.json").write_text(json.dumps(cfg))
    fails(TO_MEGATRON, "--hf-dir", other, "--save", tmp_path / "o", says="architectures='MistralForCausalLM'")
    cut = _copy(qwen2, tmp_path / "cut")
    (cut / "model.safetensors").write_bytes((qwen2 / "model.safetensors").read_bytes()[:100])
    fails(TO_MEGATRON, "--hf-dir", cut, "--save", tmp_path / "o", says="truncated inside its header")
    fails(TO_HF, "--load", converted["qwen2"], "--save", tmp_path / "o", "--hf-dir", llama,
          says="describes a different model")
    fails(TO_HF, "--load", qwen2, "--save", tmp_path / "o",
          says="is a Hugging Face folder, not a Megatron checkpoint")
    fails(TO_HF, "--load", tmp_path / "nothing", "--save", tmp_path / "o", says="no such folder")
    assert not (tmp_path / "o").exists()


def test_size_parsing():
    assert cc.parse_size("5GB") == 5 * 10**9 and cc.parse_size("2GiB") == 2 * 2**30
    assert cc.parse_size("150KB") == 150_000 and cc.parse_size("1234") == 1234
    with pytest.raises(cc.UserError):
        cc.parse_size("lots")


def test_verify_verdict(capsys):
    """--verify exits 1 above the tolerance (and on NaN), 0 within it."""
    assert cc.report_verify("t", 2e-4, 1.0, 64, 1e-4, "x") == cc.EXIT_VERIFY_FAILED
    assert "FAILED" in capsys.readouterr().out
    assert cc.report_verify("t", float("nan"), 1.0, 64, 1e-4, "x") == cc.EXIT_VERIFY_FAILED
    assert cc.report_verify("t", 3e-5, 1.0, 64, 1e-4, "x") == cc.EXIT_OK
    a = torch.tensor([[[0.0, 1.0, 0.5], [2.0, 0.0, 0.0]]])
    b = torch.tensor([[[0.0, 1.0, 1.5], [2.0, 0.0, 0.0]]])
    assert cc.compare_logits(a, b) == (1.0, 0.5)
