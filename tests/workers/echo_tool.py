"""A user tool for the tests (`rollout.tools.name=echo_tool:run`, tests/workers on PYTHONPATH): answers every call
with the length of its code, in the trainer's process (no sandbox needed)."""

from megatron_dapo.sandbox import ToolResult


def run(code: str) -> ToolResult:
    return ToolResult("ok", f"{len(code)}\n", "", 0.0)
