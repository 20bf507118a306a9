"""tools/convert_hf_to_megatron.py and tools/convert_megatron_to_hf.py (and megatron_dapo.actor.convert behind
them) on tiny random models from megatron_dapo.tiny: a Qwen2 (qkv bias, untied lm_head) and a Llama (tied
embeddings), vocab 300 so that the padded vocab differs between TP1/PP2 (384) and TP2 (512).

Round trips HF -> Megatron -> HF must be bit-identical (tensors, dtypes, config.json, tokenizer files and
chat template). Megatron logits vs transformers <= 1e-4 (fp32): TP2 and PP2 through convert_hf_to_megatron
--verify (the tool spawns 2 gloo ranks and reloads what it wrote), TP1 through convert_megatron_to_hf --verify
(reading the TP2-written checkpoint), and TP2 through the actor's own load_checkpoint of the PP2-written one.
Bad inputs must fail with one clear line and exit code 2, never a traceback: the tools run as scripts where
a test checks the command line, the library's checks run in this process.
"""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_dapo.actor import convert
from megatron_dapo.actor.convert_checks import EXIT_OK, EXIT_VERIFY_FAILED, USER_ERRORS, parse_size
from megatron_dapo.actor.convert_verify import compare_logits, hf_logits, report_verify, verify_tokens
from megatron_dapo.cli import UserError
from megatron_dapo.hf_files import SafetensorsReader
from megatron_dapo.tiny import tiny_model

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).parent / "workers" / "convert_worker.py"
TO_MEGATRON, TO_HF = REPO / "tools" / "convert_hf_to_megatron.py", REPO / "tools" / "convert_megatron_to_hf.py"

AUX_FILES = {"tokenizer.json": '{"version": "1.0", "model": {"type": "BPE"}}\n',
             "tokenizer_config.json": '{"model_max_length": 128}\n',
             "special_tokens_map.json": '{"eos_token": "<|endoftext|>"}\n',
             "chat_template.jinja": "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"}
VERIFY_LINE = re.compile(r"max \|logit diff\| = ([0-9.e+-]+) .*argmax agreement = ([0-9.]+) .*: (OK|FAILED)")


def _tiny(family: str, folder: Path, *, seed: int, tied: bool, **overrides) -> Path:
    model = tiny_model(family, seed=seed, tied=tied, vocab_size=300, max_position_embeddings=128,
                       rope_theta=50000.0, **overrides)
    with torch.no_grad():  # norms away from 1 so that a swapped or dropped norm shows in the logits
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    for name, text in AUX_FILES.items():
        (folder / name).write_text(text)
    return folder


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return _tiny("qwen2", tmp_path_factory.mktemp("qwen2"), seed=0, tied=False)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _tiny("llama", tmp_path_factory.mktemp("llama"), seed=1, tied=True, rms_norm_eps=1e-5)


def tool(script: Path, *args, env, expect: int = 0, timeout: int = 300) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True, text=True,
                       env=env, timeout=timeout)
    assert r.returncode == expect, f"exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    assert "Traceback" not in r.stderr, r.stderr[-5000:]
    return r


def error_line(r: subprocess.CompletedProcess, prog: str) -> str:
    """The tool's one-line error (whatever third-party noise came before it)."""
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith(f"{prog}: error: ")]
    assert len(lines) == 1 and r.stderr.rstrip().endswith(lines[0]), r.stderr[-3000:]
    return lines[0]


def verified(r: subprocess.CompletedProcess) -> tuple[float, float]:
    m = VERIFY_LINE.search(r.stdout)
    assert m and m.group(3) == "OK", r.stdout
    return float(m.group(1)), float(m.group(2))


def hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    reader = SafetensorsReader(folder)
    return {n: reader.get(n) for n in reader.weight_map}


def assert_identical(src: Path, out: Path) -> None:
    a, b = hf_tensors(src), hf_tensors(out)
    assert a.keys() == b.keys()
    for name, t in a.items():
        assert b[name].dtype == t.dtype and torch.equal(b[name], t), name
    assert (out / "config.json").read_bytes() == (src / "config.json").read_bytes()
    for name in [*AUX_FILES, "generation_config.json"]:
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
                p.wait()
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
        assert (ckpt / "hf" / "chat_template.jinja").is_file()
        info = json.loads((ckpt / "conversion.json").read_text())
        assert info["hf_tensors"] == n_tensors and info["dtype"] == "float32"
        assert "chat_template.jinja" in info["hf_files"]
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


@pytest.mark.slow
def test_bf16_round_trip_is_bit_identical_and_loads_into_a_bf16_actor(qwen2, tmp_path, env):
    """The GPU dtype: a bf16 checkpoint converts at TP2 (verified in fp32: the same weights, 1e-4), comes
    back bit for bit in bf16, and a bf16 actor loads it with logits within bf16 rounding of transformers'
    (max 0.05 on these ~1-magnitude logits: bf16 keeps 8 mantissa bits)."""
    from transformers import AutoModelForCausalLM

    src = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(qwen2, dtype=torch.float32).to(torch.bfloat16).save_pretrained(src)
    for name in AUX_FILES:
        shutil.copy(qwen2 / name, src / name)
    diff, _ = verified(tool(TO_MEGATRON, "--hf-dir", src, "--save", tmp_path / "mg", "--tp", 2, "--verify", env=env))
    assert diff <= 1e-4
    r = tool(TO_HF, "--load", tmp_path / "mg", "--save", tmp_path / "back", "--verify", env=env)
    assert "bfloat16" in r.stdout
    assert_identical(src, tmp_path / "back")
    (res,) = _load_in_actor(tmp_path / "mg", tmp_path / "actor", 1, 1, {**env, "DAPO_TEST_DTYPE": "bfloat16"})
    ref = hf_logits(src, verify_tokens(_spec(src)))
    diff, agree = compare_logits(res["logits"], ref)
    assert diff <= 0.05 and agree >= 0.95, (diff, agree)


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
    """The actor loads llama (written at PP2) at TP2, exports it to HF (save_hf_checkpoint), then writes a
    training checkpoint of it (optimizer state, no hf/ copy) as the trainer would."""
    root = converted["root"]
    results = _load_in_actor(converted["llama"], root / "llama_actor", 2, 1, env, root / "llama_train")
    return {"llama": results, "train_root": root / "llama_train", "export": root / "llama_actor" / "hf_export"}


def test_actor_loads_a_converted_checkpoint_at_another_layout(actor_layouts, llama):
    """Written at PP2 (vocab padded to 384), read by the actor at TP2 (512). (TP2 -> TP1 is covered by the
    qwen2 round trip: convert_megatron_to_hf --verify reads the TP2-written checkpoint at TP1.)"""
    ref = hf_logits(llama, verify_tokens(_spec(llama)))
    got = [r["logits"] for r in actor_layouts["llama"]]
    assert len(got) == 2 and all(r["padded_vocab"] == 512 for r in actor_layouts["llama"])
    for logits in got:
        diff, agree = compare_logits(logits, ref)
        assert diff <= 1e-4 and agree == 1.0, diff


def test_actor_export_keeps_weights_and_every_aux_file(actor_layouts, llama):
    """save_hf_checkpoint at TP2 (gathered shards, vocab padding removed) from the converted checkpoint's hf/:
    the source's tensors bit for bit, config.json, tokenizer files and chat_template.jinja."""
    assert_identical(llama, actor_layouts["export"])


def test_llama_tied_round_trip_through_a_training_checkpoint(actor_layouts, converted, llama, env):
    """The actor's step_<N>/ folders (optimizer state, TP2 vocab padding, no hf/ copy) export with --hf-dir;
    training TP/PP flags are ignored with a note; a non-empty output needs --force, then is replaced."""
    train_root, out = actor_layouts["train_root"], converted["root"] / "llama_hf"
    r = tool(TO_HF, "--load", train_root, "--save", out, env=env, expect=2)
    line = error_line(r, "convert_megatron_to_hf")
    assert "keeps no config.json" in line and "--hf-dir" in line, line
    out.mkdir()
    (out / "old.txt").write_text("keep me unless --force")
    with pytest.raises(UserError, match="is not empty: pass --force"):
        convert.prepare_to_hf(convert.ToHF(load=train_root, save=out, hf_dir=llama), "t")
    assert (out / "old.txt").is_file()
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
    shutil.copytree(src, dst)
    return dst


def test_config_mismatch_is_named(qwen2, tmp_path, env):
    bad = _copy(qwen2, tmp_path / "bad")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["hidden_size"] = 128  # the tensors are 64 wide
    (bad / "config.json").write_text(json.dumps(cfg))
    r = tool(TO_MEGATRON, "--hf-dir", bad, "--save", tmp_path / "out", env=env, expect=2)
    line = error_line(r, "convert_hf_to_megatron")
    assert line.startswith("convert_hf_to_megatron: error: model.embed_tokens.weight: shape [300, 64]"), line
    assert "expected [300, 128]" in line and "hidden_size=128" in line
    assert not (tmp_path / "out").exists()


def test_truncated_safetensors_is_named(qwen2, tmp_path, env):
    """Checked by the one process the user started, before it spawns the --tp 2 ranks."""
    bad = _copy(qwen2, tmp_path / "bad")
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    r = tool(TO_MEGATRON, "--hf-dir", bad, "--save", tmp_path / "out", "--tp", 2, env=env, expect=2)
    assert re.search(r"error: .*model\.safetensors: truncated: .* ends at byte \d+ .* holds only \d+",
                     error_line(r, "convert_hf_to_megatron")), r.stderr
    assert not (tmp_path / "out").exists()


def _fails(call, says: str) -> None:
    with pytest.raises(USER_ERRORS) as e:
        call()
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_layout_architecture_and_output_checks(qwen2, llama, converted, tmp_path):
    def to_megatron(hf_dir, save, **kw):
        return lambda: convert.preflight_to_megatron(convert.ToMegatron(hf_dir=hf_dir, save=save, **kw))

    def to_hf(load, save, **kw):
        return lambda: convert.prepare_to_hf(convert.ToHF(load=load, save=save, **kw), "t")

    _fails(to_megatron(qwen2, tmp_path / "o", tp=3), "num_attention_heads=4 is not divisible by tensor_parallel=3")
    _fails(to_megatron(qwen2, qwen2, force=True), "would overwrite the input")
    other = _copy(qwen2, tmp_path / "mistral")
    cfg = json.loads((other / "config.json").read_text())
    cfg.update(architectures=["MistralForCausalLM"], model_type="mistral")
    (other / "config.json").write_text(json.dumps(cfg))
    _fails(to_megatron(other, tmp_path / "o"), "architectures='MistralForCausalLM'")
    cut = _copy(qwen2, tmp_path / "cut")
    (cut / "model.safetensors").write_bytes((qwen2 / "model.safetensors").read_bytes()[:100])
    _fails(to_megatron(cut, tmp_path / "o"), "truncated inside its header")
    _fails(to_hf(converted["qwen2"], tmp_path / "o", hf_dir=llama), "describes a different model")
    _fails(to_hf(qwen2, tmp_path / "o"), "is a Hugging Face folder, not a Megatron checkpoint")
    _fails(to_hf(tmp_path / "nothing", tmp_path / "o"), "no such folder")
    _fails(to_hf(converted["qwen2"], tmp_path / "o", max_shard_size="lots"), "expected a size like 5GB")
    assert not (tmp_path / "o").exists()


def test_size_parsing():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30
    assert parse_size("150KB") == 150_000 and parse_size("1234") == 1234
    with pytest.raises(UserError):
        parse_size("lots")
    with pytest.raises(UserError):
        parse_size("0MB")


def test_verify_verdict(capsys):
    """--verify exits 1 above the tolerance (and on NaN), 0 within it."""
    assert report_verify("t", 2e-4, 1.0, 64, 1e-4, "x") == EXIT_VERIFY_FAILED
    assert "FAILED" in capsys.readouterr().out
    assert report_verify("t", float("nan"), 1.0, 64, 1e-4, "x") == EXIT_VERIFY_FAILED
    assert report_verify("t", 3e-5, 1.0, 64, 1e-4, "x") == EXIT_OK
    a = torch.tensor([[[0.0, 1.0, 0.5], [2.0, 0.0, 0.0]]])
    b = torch.tensor([[[0.0, 1.0, 1.5], [2.0, 0.0, 0.0]]])
    assert compare_logits(a, b) == (1.0, 0.5)
