"""Prompts the user controls: templates per dataset and from files, system prompt,
few-shot examples, the arithmetic instruct style, the chat template choice and the detection of a
template's default system prompt, on a real BPE tokenizer with Qwen2.5's chat template (tiny/chat.py);
and one run that uses all of them, whose exports keep the chat template."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dapo.config import ConfigError, load_config, validate
from megatron_dapo.data import DAPO_MATH_TEMPLATE, PromptFormat, load_prompts
from megatron_dapo.data.arithmetic import make_arithmetic_prompts
from megatron_dapo.data.render import default_system_prompt, render_prompt_ids, use_chat_template
from megatron_dapo.data.templates import question_of
from megatron_dapo.tiny.chat import QWEN_DEFAULT_SYSTEM, build_chat_tokenizer, save_chat_model
from megatron_dapo.types import Prompt

REPO = Path(__file__).resolve().parents[1]
PAPER_INSTRUCTION = ("Solve the following math problem step by step. The last line of your response should be of "
                     "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
                     "{problem}\n\nRemember to put your answer on its own line after \"Answer:\".")
PROBLEM = "What is the sum of the first 3 primes?"


def user(content):
    return {"role": "user", "content": content}


def dapo_rows(tmp_path, system=None):
    """A DAPO-Math-17K row as the dataset stores it: the instruction already around the problem."""
    messages = ([{"role": "system", "content": system}] if system else []) + [
        user(PAPER_INSTRUCTION.format(problem=PROBLEM))]
    row = {"data_source": "math_dapo", "prompt": messages, "ability": "MATH",
           "reward_model": {"ground_truth": "10", "style": "rule-lighteval/MATH_v2"}, "extra_info": {"index": "x"}}
    path = tmp_path / "dapo.jsonl"
    path.write_text(json.dumps(row) + "\n")
    return str(path)


def test_the_dapo_instruction_is_the_papers_word_for_word():
    assert DAPO_MATH_TEMPLATE.replace("{question}", "{problem}") == PAPER_INSTRUCTION
    assert question_of(PAPER_INSTRUCTION.format(problem=PROBLEM)) == PROBLEM
    assert question_of("37+45=") == "37+45="


@pytest.mark.parametrize("template, expected", [
    ("auto", PAPER_INSTRUCTION.format(problem=PROBLEM)),  # rows keep what they carry
    ("dapo_math", PAPER_INSTRUCTION.format(problem=PROBLEM)),  # the same text, rebuilt from the problem
    ("raw", PROBLEM),
    ("gsm8k", PROBLEM + " Let's think step by step and output the final answer after \"####\"."),
    ("dapo_math_tool", PAPER_INSTRUCTION.format(problem=PROBLEM).replace(
        "step by step. ", "step by step. You may run Python to compute: write the code in a ```python block; what it "
        "prints comes back in an ```output block right after it. ")),
])
def test_builtin_templates_on_dapo_rows(tmp_path, template, expected):
    (prompt,) = load_prompts(dapo_rows(tmp_path), prompt_format=PromptFormat(template)).prompts
    assert prompt.messages == (user(expected),) and prompt.ground_truth == "10"


def test_the_tool_template_goes_with_the_tool_and_its_fences():
    load_config(None, ["data.prompt_template=dapo_math_tool", "rollout.tools.name=python", "rollout.streaming=false"])
    with pytest.raises(ConfigError, match="dapo_math_tool tells the model it may run Python, but rollout.tools"):
        load_config(None, ["data.prompt_template=dapo_math_tool"])
    with pytest.raises(ConfigError, match="dapo_math_tool names the default fences"):
        load_config(None, ["data.prompt_template=dapo_math_tool", "rollout.tools.name=python",
                           "rollout.streaming=false", "rollout.tools.code_open=<code>"])


def test_gsm8k_rows_get_the_dapo_instruction_by_default(tmp_path):
    path = tmp_path / "gsm.jsonl"
    path.write_text(json.dumps({"question": "Tom has 3 apples. How many?", "answer": "3 #### 3"}) + "\n")
    (auto,) = load_prompts(str(path)).prompts
    (raw,) = load_prompts(str(path), prompt_format=PromptFormat("raw")).prompts
    assert auto.messages == (user(PAPER_INSTRUCTION.format(problem="Tom has 3 apples. How many?")),)
    assert raw.messages == (user("Tom has 3 apples. How many?"),)


def test_template_files_format_string_and_jinja(tmp_path):
    py = tmp_path / "t.txt"
    py.write_text("[{data_source}] Q: {question}\nA:")
    jinja = tmp_path / "t.jinja"
    jinja.write_text("{{ problem | upper }} ({{ data_source }})")
    fmt_py, fmt_j = PromptFormat(str(py)), PromptFormat(str(jinja))
    (p,) = make_arithmetic_prompts(1, 0)
    assert fmt_py.apply(p).messages == (user(f"[arithmetic] Q: {p.messages[0]['content']}\nA:"),)
    assert fmt_j.apply(p).messages == (user(f"{p.messages[0]['content'].upper()} (arithmetic)"),)


@pytest.mark.parametrize("text, suffix, fragment", [
    ("no field at all", ".txt", "never uses"),
    ("{question} {answer}", ".txt", "not a valid format string"),
    ("{{ question", ".jinja", "Jinja error"),
    ("{{ data_source }}", ".j2", "never uses"),
])
def test_bad_template_files_are_named(tmp_path, text, suffix, fragment):
    path = tmp_path / f"bad{suffix}"
    path.write_text(text)
    with pytest.raises(ValueError, match=fragment):
        PromptFormat(str(path))
    with pytest.raises(ValueError, match="no such file"):
        PromptFormat(str(tmp_path / "missing.txt"))


def test_system_prompt_and_few_shot(tmp_path):
    shots = tmp_path / "shots.jsonl"
    shots.write_text(json.dumps({"question": "1+1=", "response": "Answer: 2"}) + "\n\n"
                     + json.dumps({"question": "2*3=", "response": "Answer: 6"}) + "\n")
    fmt = PromptFormat.from_files("auto", "Be exact.", str(shots))
    (p,) = make_arithmetic_prompts(1, 0)
    q = p.messages[0]["content"]
    assert fmt.apply(p).messages == (
        {"role": "system", "content": "Be exact."}, user("1+1="), {"role": "assistant", "content": "Answer: 2"},
        user("2*3="), {"role": "assistant", "content": "Answer: 6"}, user(q))
    # under a template the examples' questions are formatted like the prompt's; the row's system is replaced
    (row,) = load_prompts(dapo_rows(tmp_path, system="old"), prompt_format=PromptFormat.from_files(
        "dapo_math", "", str(shots))).prompts
    assert row.messages[0] == {"role": "system", "content": ""}
    assert row.messages[1] == user(PAPER_INSTRUCTION.format(problem="1+1="))
    (kept,) = load_prompts(dapo_rows(tmp_path, system="old"), prompt_format=PromptFormat("raw")).prompts
    assert kept.messages == ({"role": "system", "content": "old"}, user(PROBLEM))


def test_a_row_without_user_message_is_skipped_under_a_template(tmp_path):
    path = tmp_path / "odd.jsonl"
    row = {"data_source": "x", "prompt": [{"role": "system", "content": "only"}], "reward_model": {"ground_truth": "1"}}
    path.write_text(json.dumps(row) + "\n")
    assert len(load_prompts(str(path)).prompts) == 1  # auto: the row as stored
    result = load_prompts(str(path), prompt_format=PromptFormat("raw"))
    assert not result.prompts and result.skipped == {"malformed_row": 1}


def test_bad_few_shot_files(tmp_path):
    bad = tmp_path / "bad.jsonl"
    for text, fragment in [('{"question": "q"}\n', "needs string"), ("not json\n", "not JSON"), ("\n", "no example")]:
        bad.write_text(text)
        with pytest.raises(ValueError, match=fragment):
            PromptFormat.from_files("auto", None, str(bad))


def test_length_limit_counts_the_formatted_prompt(tmp_path):
    path = dapo_rows(tmp_path)
    limit = len(PROBLEM) + 1
    assert len(load_prompts(path, max_prompt_chars=limit, prompt_format=PromptFormat("raw")).prompts) == 1
    assert load_prompts(path, max_prompt_chars=limit).skipped == {"prompt_too_long": 1}


def test_arithmetic_instruct_style():
    plain = make_arithmetic_prompts(3, 5)
    instruct = load_prompts("builtin:arithmetic?n=3&seed=5&style=instruct").prompts
    for a, b in zip(plain, instruct):
        expression = a.messages[0]["content"].removesuffix("=")
        assert b.messages[0]["content"] == (f'Compute {expression}. End your response with a line of the form '
                                            '"Answer: N", where N is the integer result.')
        assert (a.ground_truth, a.uid) == (b.ground_truth, b.uid)
    with pytest.raises(ValueError, match="style"):
        load_prompts("builtin:arithmetic?style=chatty")


# --------------------------------------------------------------------------------- chat templates


@pytest.fixture(scope="module")
def chat_tok():
    return build_chat_tokenizer()


def qwen_text(*turns, system=QWEN_DEFAULT_SYSTEM):
    """Qwen2.5's chat format written out by hand."""
    text = f"<|im_start|>system\n{system}<|im_end|>\n"
    for role, content in turns:
        text += f"<|im_start|>{role}\n{content}<|im_end|>\n"
    return text + "<|im_start|>assistant\n"


def test_rendering_through_the_qwen_chat_template(chat_tok):
    p = Prompt(uid="t/0", messages=(user("12+7="),), ground_truth="19")
    assert render_prompt_ids(chat_tok, p) == chat_tok.encode(qwen_text(("user", "12+7=")), add_special_tokens=False)
    with_system = Prompt(uid="t/1", messages=({"role": "system", "content": "Be exact."}, user("1+2=")), ground_truth="3")
    assert chat_tok.decode(render_prompt_ids(chat_tok, with_system)) == qwen_text(("user", "1+2="), system="Be exact.")


def test_default_system_prompt_is_detected(chat_tok):
    assert default_system_prompt(chat_tok) == QWEN_DEFAULT_SYSTEM
    tok = build_chat_tokenizer()
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    assert default_system_prompt(tok) is None  # ChatML without a default
    tok.chat_template = "{{ raise_exception('System role not supported') if messages[0].role == 'system' }}x"
    assert default_system_prompt(tok) is None
    tok.chat_template = None
    assert default_system_prompt(tok) is None


def test_chat_template_choice(chat_tok, tmp_path):
    tok = build_chat_tokenizer()
    assert "own" in use_chat_template(tok, "auto") and tok.chat_template == chat_tok.chat_template
    assert "none" in use_chat_template(tok, "none") and tok.chat_template is None
    p = Prompt(uid="t/0", messages=({"role": "system", "content": "S"}, user("12+7=")), ground_truth="19")
    assert tok.decode(render_prompt_ids(tok, p)) == "S\n\n12+7="  # plain text: turns apart by a blank line
    path = tmp_path / "mine.jinja"
    path.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }} {% endfor %}")
    assert str(path) in use_chat_template(tok, str(path))
    assert tok.decode(render_prompt_ids(tok, p)) == "[system] S [user] 12+7= "
    with pytest.raises(ValueError, match="no such file"):
        use_chat_template(tok, str(tmp_path / "nope.jinja"))


def test_config_checks_for_prompts(tmp_path):
    for overrides, fragment in [
        (["data.prompt_template=gsm8k"], "reward.answer_fallback=boxed"),
        ([f"data.prompt_template={tmp_path / 'nope.txt'}"], "data.prompt_template"),
        ([f"data.few_shot_path={tmp_path / 'nope.jsonl'}"], "data.few_shot_path"),
        (["model.chat_template=chatml"], "model.chat_template"),
    ]:
        with pytest.raises(ConfigError, match=fragment):
            load_config(None, overrides)
    validate(load_config(None, ["data.prompt_template=gsm8k", "reward.answer_fallback=boxed"]))


# ------------------------------------------------------------------------------------------ a whole run


def test_a_run_with_every_prompt_control_keeps_the_chat_template(tmp_path, python_env):
    """A Qwen2-architecture model with the Qwen2.5 chat template, the DAPO template on the instruct
    arithmetic task, few-shot examples and a user reward that raises on some samples: two steps, a
    checkpoint after each; the exports carry chat_template.jinja; the start-up summary says which
    template and which (injected) system prompt are used."""
    model = save_chat_model(tmp_path / "chat", "qwen2", max_position_embeddings=1024)
    shots = tmp_path / "shots.jsonl"
    shots.write_text(json.dumps({"question": "Compute 1+1.", "response": "1+1=2\nAnswer: 2"}) + "\n")
    env = {**python_env, "PYTHONPATH": f"{REPO / 'tests' / 'workers'}:{python_env['PYTHONPATH']}"}
    cmd = [sys.executable, "-m", "megatron_dapo.train", "--config", str(REPO / "examples/configs/tiny_cpu.yaml"),
           f"model.hf_dir={model}", f"checkpoint.dir={tmp_path / 'ckpt'}", f"logging.tensorboard_dir={tmp_path / 'tb'}",
           "logging.run_name=chat", "train.steps=2", "checkpoint.save_every=1", "eval.every_steps=0",
           "data.train_path=builtin:arithmetic?n=64&seed=0&style=instruct", "data.prompt_template=dapo_math",
           f"data.few_shot_path={shots}", "reward.name=length_reward:flaky", "rollout.max_prompt_len=1024",
           "train.prompt_batch_size=4", "train.mini_batch_size=2", "algo.group_size=4", "algo.filter_metric=score",
           "logging.samples_every=1", "logging.samples_per_step=4"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-6000:]
    assert "chat template: the tokenizer's own (model.chat_template=auto)" in r.stderr
    assert f"system prompt: '{QWEN_DEFAULT_SYSTEM}', inserted by the chat template" in r.stderr
    assert r.stderr.count("reward length_reward:flaky failed (RuntimeError: flaky reward refuses length") == 1
    assert "Traceback" in r.stderr  # the first failure comes with its traceback, the others are counted
    source = (model / "chat_template.jinja").read_text()
    run = tmp_path / "ckpt" / "chat"
    for folder in (run / "hf_final", run / "step_00000001" / "hf", run / "step_00000002" / "hf"):
        assert (folder / "chat_template.jinja").read_text() == source, folder
    record = json.loads((tmp_path / "tb" / "chat" / "samples" / "step_1.jsonl").read_text().splitlines()[0])
    assert record["prompt"].startswith(f"<|im_start|>system\n{QWEN_DEFAULT_SYSTEM}<|im_end|>\n"
                                       f"<|im_start|>user\n{PAPER_INSTRUCTION.format(problem='Compute 1+1.')}")
    assert "Answer: 2<|im_end|>" in record["prompt"] and record["prompt"].endswith("<|im_start|>assistant\n")
    from megatron_dapo.metrics import read_scalars

    tb = read_scalars(tmp_path / "tb" / "chat")
    assert sum(tb["reward/failures"].values()) >= 1 and set(tb["alarm/no_correct_answers"]) == {1, 2}
    assert all(v > 0 for v in tb["perf/rollout_tokens_per_s"].values())
