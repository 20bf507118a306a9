"""Multi-turn tool-integrated rollouts (rollout.tools): the policy's code blocks run in the sandbox and their
output continues the response as observation tokens, in the context and out of the loss."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from megatron_dapo.config.tools import ToolsConfig
from megatron_dapo.rollout.base import RolloutEngine
from megatron_dapo.rollout.tools.engine import ToolEngine, ToolStream
from megatron_dapo.rollout.tools.runner import Tool, ToolLoadError, make_tool
from megatron_dapo.rollout.tools.turns import Conversation, close_stop_ids, find_code

__all__ = ["ToolEngine", "ToolStream", "Tool", "ToolLoadError", "make_tool", "with_tools", "Conversation",
           "close_stop_ids", "find_code"]


def with_tools(engine: RolloutEngine, cfg: ToolsConfig, tokenizer: Any, eos_ids: Iterable[int]) -> ToolEngine:
    """`engine` made multi-turn with the tool `cfg.name` names (started here: a sandbox that cannot start is a
    one-line SandboxUnavailable now, not at the first call); its shutdown closes the tool."""
    tool = make_tool(cfg)
    return ToolEngine(engine, cfg, tokenizer, tool.submit, eos_ids=eos_ids, on_shutdown=tool.close)
