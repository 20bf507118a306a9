"""The GPU check's Python parts (tools/gpu_check.sh runs them; files, not strings in bash, so the type
check and the CPU tests read them).

    python tools/gpu_check.py cuda                               # the `cuda` stage: versions, or it fails
    python tools/gpu_check.py summary LOG_DIR OUT_DIR MODE SECONDS

`summary` reads each stage's log, exit status and time from LOG_DIR (NAME.log, NAME.rc, NAME.s) and writes
OUT_DIR/summary.txt (each stage's verdict and time, the tail of every failing stage's log) and
OUT_DIR/summary.json (the same plus the benchmarks' JSON rows and their ratios); it prints the text, then
the JSON as the last line of stdout. Nothing else goes to OUT_DIR: the device tool returns few files.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

STAGES = ("install", "cuda", "pytest", "tiny_dapo", "bench_actor", "bench_loss", "bench_dynamic")
BENCHES = ("bench_loss", "bench_actor", "bench_dynamic", "tiny_dapo")
TAIL_LINES = 40
TAIL_CHARS = 4000


def read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def verdict(rc: str) -> str:
    """A stage's exit status (NAME.rc) in words: timeout's 124 / 137 are a timeout, not a failure."""
    if rc in ("", "not run"):
        return "not run"
    if rc in ("dry-run", "skipped: budget", "skipped: not selected"):
        return rc
    if rc == "0":
        return "ok"
    return "timeout" if rc in ("124", "137") else f"failed (rc {rc})"


def tail(log: str) -> str:
    return "\n".join(log.splitlines()[-TAIL_LINES:])[-TAIL_CHARS:]


def json_lines(log: str) -> list[dict[str, Any]]:
    rows = []
    for line in log.splitlines():
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a log line that merely starts with a brace
    return rows


def ratios(summary: dict[str, Any]) -> None:
    """The benchmarks' ratios: each actor loss path vs the naive one, streaming vs rounds."""
    actor = {r["impl"]: r for r in summary.get("bench_actor", []) if "impl" in r}
    if "naive" in actor:
        base = actor["naive"]
        summary["actor_vs_naive"] = {
            k: {"peak": round(r["peak_loss_bytes"] / max(base["peak_loss_bytes"], 1), 4),
                "step_time": round(r["step_s"] / base["step_s"], 3)} for k, r in actor.items() if k != "naive"}
    dynamic = [r for r in summary.get("bench_dynamic", []) if "mode" in r]
    rounds = {r["ramble_frac"]: r for r in dynamic if r["mode"] == "rounds"}
    summary["streaming_vs_rounds"] = {
        f'{r["mode"]}@{r["ramble_frac"]}': {
            "wall": round(r["wall_s"] / rounds[r["ramble_frac"]]["wall_s"], 3),
            "forward_passes": round(r["forward_passes"] / max(rounds[r["ramble_frac"]]["forward_passes"], 1), 3)}
        for r in dynamic if r["mode"] != "rounds" and r["ramble_frac"] in rounds}


def build(logs: Path, mode: str, seconds: int) -> tuple[dict[str, Any], str]:
    """(the JSON summary, its text form) of the stages' files in `logs`."""
    summary: dict[str, Any] = {"mode": mode, "seconds": seconds, "stages": {}, "stage_seconds": {}, "tails": {}}
    lines = [f"gpu_check ({mode}): {seconds} s"]
    for name in STAGES:
        v = verdict(read(logs / f"{name}.rc").strip())
        secs = read(logs / f"{name}.s").strip()
        log = read(logs / f"{name}.log")
        summary["stages"][name] = v
        summary["stage_seconds"][name] = int(secs) if secs.isdigit() else None
        lines.append(f"  {name:<14} {v:<22} {secs or '-':>4} s")
        if v.startswith(("failed", "timeout")):
            summary["tails"][name] = tail(log)
        if name == "cuda" and log.strip():
            summary["cuda"] = log.strip().splitlines()[-1]
        if name == "pytest":
            found = re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", log)
            summary["pytest"] = {k: int(n) for n, k in found}
        if name in BENCHES:
            summary[name] = json_lines(log)
    ratios(summary)
    for name, text in summary["tails"].items():
        lines += [f"--- {name}: the last {TAIL_LINES} lines of its log", text]
    return summary, "\n".join(lines)


def write(logs: Path, out: Path, mode: str, seconds: int) -> dict[str, Any]:
    summary, text = build(logs, mode, seconds)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.txt").write_text(text + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(text)
    print(json.dumps(summary))
    return summary


def cuda() -> None:
    import megatron.core
    import torch

    if not torch.cuda.is_available():
        sys.exit("no CUDA")
    print(torch.__version__, torch.cuda.get_device_name(), megatron.core.__version__)


def main(argv: list[str]) -> int:
    if argv[:1] == ["cuda"]:
        cuda()
        return 0
    if argv[:1] == ["summary"] and len(argv) == 5:
        write(Path(argv[1]), Path(argv[2]), argv[3], int(argv[4]))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
