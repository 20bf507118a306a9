"""Every shell command the README and docs/ show runs in a test, so none can rot; every relative link
resolves.

Convention (also in the README's header comment): in a ```bash fence of README.md or of any docs/**/*.md,
each command (a line, with its `\\` continuation lines) is preceded by a directive line

    # test: [tier=slow|slurm|sglang|gpu] [timeout=SECONDS] [needs=PATH] [VAR=value ...] run [ARGS ...]
    # test: skip REASON

`run` executes the command from a sandbox folder (below) with ARGS appended (shortening overrides such as
`train.steps=1`) and VAR=value in its environment (`DRY_RUN=1` for the dry-run form of a launcher);
it must exit 0. `tier=` gives the test that pytest marker (`-m slow` ...). `needs=` names a sandbox
path an earlier command produces: commands run in file order, README.md first, then the docs/ files in
sorted path order. A command without a directive fails `test_every_readme_command_has_a_directive`. The
fences right after `<!-- ci:run -->` and `<!-- ci:test -->` (the README's first screen) are run exactly
as written by `.ci/run`, which this module checks.

The sandbox: `examples/` and `tools/` of this checkout, `checkpoints/tiny_base` (the tiny base, built
here quickly), `models/my-model` (a tiny Llama with a Qwen2.5-style chat template), `models/Qwen2.5-32B`
(a tiny Qwen2 stand-in with 8 heads, so TP=8 divides it, with a tokenizer) and the 32B config's parquet
files (support.stand_in_32b: the trainer's --dry-run reads them), `data/train.jsonl` and `data/val.jsonl`
(GSM8K-format rows), and `checkpoints/dapo_qwen2.5_32b` pointing at `checkpoints/qwen32b_mcore`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = [README, *sorted((REPO / "docs").rglob("*.md"))]  # the order the commands run in
TIERS = ("slow", "slurm", "sglang", "gpu")
DIRECTIVE = re.compile(r"^#\s*test:\s*(.*)$")


@dataclass
class Command:
    line: int
    text: str
    directive: str | None
    source: str = "README.md"  # the file, relative to the repository
    env: dict[str, str] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)
    tier: str | None = None
    timeout: int = 600
    needs: str | None = None
    skip: str | None = None

    @property
    def name(self) -> str:
        words = [w for w in shlex.split(self.text, comments=True) if "=" not in w or w.startswith("-")][:3]
        stem = Path(self.source).with_suffix("").as_posix().replace("/", "-")
        prefix = "" if self.source == "README.md" else stem + "-"  # the README's ids as before
        return f"{prefix}L{self.line}-" + "-".join(Path(w).name for w in words)

    @property
    def where(self) -> str:
        return f"{self.source} line {self.line}"


def parse_directive(cmd: Command) -> Command:
    spec = cmd.directive or ""
    if spec.startswith("skip"):
        cmd.skip = spec[4:].lstrip(": ").strip() or "no reason given"
        if cmd.skip == "no reason given":
            raise ValueError(f"{cmd.where}: `# test: skip` needs a reason")
        return cmd
    words = shlex.split(spec)
    if "run" not in words:
        raise ValueError(f"{cmd.where}: directive {spec!r} has neither `run` nor `skip`")
    at = words.index("run")
    for word in words[:at]:
        key, sep, value = word.partition("=")
        if not sep:
            raise ValueError(f"{cmd.where}: {word!r} in {spec!r} is not KEY=VALUE")
        if key == "tier":
            if value not in TIERS:
                raise ValueError(f"{cmd.where}: tier={value}: one of {TIERS}")
            cmd.tier = value
        elif key == "timeout":
            cmd.timeout = int(value)
        elif key == "needs":
            cmd.needs = value
        else:
            cmd.env[key] = value
    cmd.args = words[at + 1:]
    return cmd


def readme_commands(text: str, source: str = "README.md") -> tuple[list[Command], list[tuple[str, str]]]:
    """(the commands of every bash fence, [(ci marker, first line of its fence)]) of one markdown file."""
    commands, ci, lines = [], [], text.splitlines()
    i, marker = 0, None
    while i < len(lines):
        line = lines[i].strip()
        if line.startswith("<!-- ci:"):
            marker = line
        fence = re.match(r"^```(\w*)$", line)
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        body = lines[i + 1:end]
        if fence.group(1) in ("bash", "sh"):
            if marker is not None:
                ci.append((marker, body[0]))
            else:
                commands += _fence_commands(body, first_line=i + 2, source=source)
        marker, i = None, end + 1
    return commands, ci


def _fence_commands(body: list[str], first_line: int, source: str) -> list[Command]:
    out, directive, k = [], None, 0
    while k < len(body):
        line = body[k].strip()
        found = DIRECTIVE.match(line)
        if found:
            directive = found.group(1).strip()
        elif line and not line.startswith("#"):
            start, text = k, body[k]
            while text.rstrip().endswith("\\") and k + 1 < len(body):
                k += 1
                text = text.rstrip()[:-1] + " " + body[k].strip()
            out.append(Command(line=first_line + start, text=text.strip(), directive=directive,
                               source=source))
            directive = None
        k += 1
    return out


def all_commands() -> tuple[list[Command], list[tuple[str, str]]]:
    """Every file's commands in run order, and the ci markers (README.md's: .ci/run reads no other file)."""
    commands, ci = [], []
    for path in DOCS:
        found, markers = readme_commands(path.read_text(), source=path.relative_to(REPO).as_posix())
        commands += found
        # a marker in docs/ keeps its file in the name, so the first-screen test fails on it
        ci += markers if path == README else [(f"{path.relative_to(REPO)}: {m}", f) for m, f in markers]
    return commands, ci


COMMANDS, CI_FENCES = all_commands()


def test_every_readme_command_has_a_directive():
    missing = [f"{c.where}: {c.text}" for c in COMMANDS if c.directive is None]
    assert not missing, "commands without a `# test: ...` line before them:\n" + "\n".join(missing)
    for c in COMMANDS:
        parse_directive(c)  # every directive parses
    assert len(COMMANDS) >= 10


def test_the_first_screen_is_what_ci_runs():
    """.ci/run extracts the command after each ci marker with its own awk: the same line as here."""
    assert {m for m, _ in CI_FENCES} == {"<!-- ci:run -->", "<!-- ci:test -->"}
    script = (REPO / ".ci" / "run").read_text()
    function = re.search(r"^readme_command\(\) \{.*?^\}", script, re.S | re.M).group(0)
    for marker, first in CI_FENCES:
        name = marker.removeprefix("<!-- ci:").removesuffix(" -->")
        got = subprocess.run(["bash", "-c", f"{function}\nreadme_command {name}"], cwd=REPO, capture_output=True,
                             text=True, timeout=30).stdout.strip()
        assert got == first.strip(), (marker, got)


def test_the_first_screen_names_the_cpu_wheel_for_plain_pypi_and_runs_without_the_dev_extra():
    """Issue 41: on plain PyPI `torch==2.13.0` is the CUDA build, so the first screen names PyTorch's CPU index (CI's
    machines keep the CPU wheel on disk and reach no other index, so the ci lines themselves do not use it); running
    installs the package alone, the tests `.[dev]`."""
    first_screen = "\n".join(README.read_text().splitlines()[:35])
    assert "--index-url https://download.pytorch.org/whl/cpu" in first_screen
    fences = dict(CI_FENCES)
    assert "pip install -e . " in fences["<!-- ci:run -->"] and "[dev]" not in fences["<!-- ci:run -->"]
    assert '".[dev]"' in fences["<!-- ci:test -->"]


def test_every_source_path_the_readme_names_exists():
    """`megatron_dapo/...`, `examples/...`, `tools/...` in code spans name real files or folders."""
    named = set(re.findall(r"`((?:megatron_dapo|examples|tools)/[\w./-]*)`", README.read_text()))
    missing = sorted(p for p in named if not (REPO / p).exists())
    assert named and not missing, missing


def test_the_folders_the_readme_puts_your_files_in_are_ignored():
    """The README's data/train.jsonl and models/my-model stay out of `git status`."""
    for path in ("data/train.jsonl", "models/my-model/config.json", "runs/x/summary.png"):
        r = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=REPO, timeout=30)
        assert r.returncode == 0, f"{path} is not git-ignored"


# ------------------------------------------------------------------------------------------ the links

LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)|<img\s[^>]*src=\"([^\"]+)\"")


def markdown_links(text: str) -> list[tuple[int, str]]:
    """(line, target) of every markdown link, image and <img src> outside code fences and code spans."""
    out, fenced = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out += [(n, a or b) for a, b in (m.groups() for m in LINK.finditer(re.sub(r"`[^`]*`", "", line)))]
    return out


def heading_anchors(text: str) -> set[str]:
    """The #anchors GitHub gives the file's headings (lower case, punctuation dropped, spaces to '-')."""
    seen: dict[str, int] = {}
    fenced = False
    for line in text.splitlines():
        if line.strip().startswith("```"):
            fenced = not fenced
        if fenced or not (m := re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)):
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).replace("`", "").lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        if seen[slug]:
            seen[f"{slug}-{seen[slug]}"] = 0
    return set(seen)


def _relative_links():
    for path in DOCS:
        for line, target in markdown_links(path.read_text()):
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http(s):, mailto: ...: not ours
                yield path, line, target


def test_every_relative_link_resolves():
    links = list(_relative_links())
    assert any(path != README for path, _, _ in links), "expected the README and docs/ to link each other"
    broken = [f"{path.relative_to(REPO)}:{line}: {target}" for path, line, target in links
              if target.split("#")[0] and not (path.parent / target.split("#")[0]).exists()]
    assert not broken, "relative links to files that do not exist:\n" + "\n".join(broken)


def test_every_link_anchor_names_a_heading():
    broken = []
    for path, line, target in _relative_links():
        file, _, fragment = target.partition("#")
        dest = path.parent / file if file else path
        if fragment and dest.suffix == ".md" and dest.exists() \
                and fragment not in heading_anchors(dest.read_text()):
            broken.append(f"{path.relative_to(REPO)}:{line}: {target}")
    assert not broken, "links to a #heading the file does not have:\n" + "\n".join(broken)


# ------------------------------------------------------------------------------------------ the sandbox


def gsm8k_rows(n: int, seed: int) -> str:
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(2, 40), rng.randint(2, 40)
        rows.append({"question": f"Tom has {a} apples and buys {b} more. How many apples does he have now?",
                     "answer": f"Tom has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b}"})
    return "".join(json.dumps(r) + "\n" for r in rows)


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory) -> Path:
    from support import stand_in_32b

    from megatron_dapo.tiny import ensure_tiny_base
    from megatron_dapo.tiny.chat import save_chat_model

    root = tmp_path_factory.mktemp("readme")
    for name in ("examples", "tools"):
        (root / name).symlink_to(REPO / name)
    ensure_tiny_base(root / "checkpoints" / "tiny_base", seconds=8)
    save_chat_model(root / "models" / "my-model", "llama", num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=2048)
    stand_in_32b(root)  # models/Qwen2.5-32B, data/dapo-math-17k.parquet, data/aime-2024.parquet
    (root / "data" / "train.jsonl").write_text(gsm8k_rows(64, 0))
    (root / "data" / "val.jsonl").write_text(gsm8k_rows(16, 1))
    (root / "checkpoints" / "dapo_qwen2.5_32b").symlink_to("qwen32b_mcore")
    return root


def _params():
    for c in COMMANDS:
        try:
            parse_directive(c)
        except ValueError:
            pass  # reported by test_every_readme_command_has_a_directive
        marks = [getattr(pytest.mark, c.tier)] if c.tier else []
        yield pytest.param(c, id=c.name, marks=marks)


@pytest.mark.parametrize("cmd", list(_params()))
def test_readme_command(cmd: Command, sandbox: Path):
    if cmd.directive is None:
        pytest.fail(f"{cmd.where} has no `# test:` directive: {cmd.text}")
    if cmd.skip:
        pytest.skip(f"{cmd.where}: {cmd.skip}")
    if cmd.needs and not (sandbox / cmd.needs).exists():
        pytest.fail(f"{cmd.where} needs {cmd.needs}, which an earlier README / docs command makes: "
                    "run the whole module")
    words = shlex.split(cmd.text, comments=True) + cmd.args
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
           **cmd.env}
    r = subprocess.run(["bash", "-c", shlex.join(words)], cwd=sandbox, env=env, capture_output=True, text=True,
                       timeout=cmd.timeout)
    assert r.returncode == 0, (f"{cmd.where}: {cmd.text}\nexit {r.returncode}\n"
                               f"stdout: {r.stdout[-3000:]}\nstderr: {r.stderr[-5000:]}")
