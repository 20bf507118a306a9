""".ci/run's stage budgets: a stage over 120% of its budget fails CI, naming itself; within it, CI goes on."""

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run_stages(budget: int, took: int) -> subprocess.CompletedProcess:
    script = (REPO / ".ci" / "run").read_text()
    budgets = re.search(r"^declare -A BUDGET=\(.*?^\)", script, re.S | re.M).group(0)
    stage = re.search(r"^stage\(\) \{.*?^\}", script, re.S | re.M).group(0)
    body = f"{budgets}\nBUDGET[x]={budget}\n{stage}\nstage x\nstage_t0=$((SECONDS - {took}))\nstage y\necho after"
    return subprocess.run(["bash", "-c", body], capture_output=True, text=True, timeout=30)


def test_a_stage_over_120_percent_of_its_budget_fails_naming_itself():
    r = _run_stages(budget=10, took=13)
    assert r.returncode == 1 and "after" not in r.stdout
    assert '"x" took 13 s, over 120% of its 10 s budget' in r.stderr, r.stderr


def test_a_stage_within_its_budget_goes_on():
    r = _run_stages(budget=10, took=12)
    assert r.returncode == 0 and "x took 12 s (budget 10 s)" in r.stdout and "after" in r.stdout


def test_every_budget_names_a_stage_the_script_runs():
    script = (REPO / ".ci" / "run").read_text()
    budgets = re.search(r"^declare -A BUDGET=\(.*?^\)", script, re.S | re.M).group(0)
    names = re.findall(r'\["([^"]+)"\]=', budgets)
    stages = set(re.findall(r'^\s*stage "([^"$]+)"', script, re.M)) | {f"{t} tier" for t in
                                                                        re.findall(r"^run_tier (\w+) ", script, re.M)}
    assert names and not set(names) - stages, set(names) - stages
