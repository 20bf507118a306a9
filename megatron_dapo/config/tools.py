"""`rollout.tools`: multi-turn tool-integrated rollouts (rollout/tools/). `name: none` is today's single turn."""

from __future__ import annotations

import re
from dataclasses import dataclass

from megatron_dapo.config.fields import knob
from megatron_dapo.sandbox.types import SandboxConfig

TOOL_FUNCTION = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


@dataclass(kw_only=True)
class ToolsConfig:
    name: str = "none"
    """none = single-turn rollouts (bit for bit as without tools); python = the policy's fenced code blocks run in
    the sandbox (megatron_dapo/sandbox/) and their output comes back as an observation; or `module.path:function`,
    a callable (code: str) -> sandbox.ToolResult, imported once (it runs in this process: sandbox it yourself)."""
    max_calls: int = knob(2, "[1, inf)")
    """Tool calls per sample at most; after the last one the policy continues without stopping at code blocks."""
    max_output_tokens: int = knob(64, "[1, inf)")
    """An observation's result text (stdout, then stderr) is cut to this many tokens, the wrapping kept.
    rollout.max_response_len bounds everything after the prompt, observations included."""
    code_open: str = "```python\n"
    """A code block starts with this text..."""
    code_close: str = "```"
    """... and ends with this one: generation stops there and the block runs."""
    output_open: str = "\n```output\n"
    """The observation appended after a code block: output_open + result + output_close, as token ids."""
    output_close: str = "\n```\n"
    timeout_s: float = knob(10.0, "(0, inf)")
    """Wall-clock limit of one call (status timeout); the other sandbox limits are SandboxConfig's defaults."""
    memory_mb: int = knob(1024, "[16, inf)")
    """Address space of each sandboxed process."""
    workers: int = knob(4, "[1, inf)")
    """Calls run in parallel (the sandbox pool)."""
    site_packages: bool = True
    """The sandbox's Python sees this interpreter's site-packages (read-only); false = stdlib only."""
    sandbox_url: str = ""
    """A SandboxFusion-compatible service (POST {url}/run_code) instead of the local bubblewrap sandbox."""

    @property
    def enabled(self) -> bool:
        return self.name != "none"

    def sandbox(self) -> SandboxConfig:
        return SandboxConfig(timeout_s=self.timeout_s, memory_mb=self.memory_mb, workers=self.workers,
                             site_packages=self.site_packages, url=self.sandbox_url)


def tools_problems(tools: ToolsConfig) -> list[str]:
    """The tool's name and delimiters (the features multi-turn samples cannot use: validation.py)."""
    p: list[str] = []
    if tools.name not in ("none", "python") and not TOOL_FUNCTION.fullmatch(tools.name):
        p.append(f"rollout.tools.name={tools.name!r} must be none, python or module.path:function")
    for key in ("code_open", "code_close", "output_open", "output_close"):
        if not getattr(tools, key):
            p.append(f"rollout.tools.{key} must not be empty")
    if tools.sandbox_url and not tools.sandbox_url.startswith(("http://", "https://")):
        p.append(f"rollout.tools.sandbox_url={tools.sandbox_url!r} must start with http:// or https://")
    return p
