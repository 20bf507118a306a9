"""The tool `rollout.tools.name` stands for, as `submit(code) -> Future[ToolResult]` plus its `close`."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from megatron_dapo.config.fields import import_named
from megatron_dapo.config.tools import ToolsConfig
from megatron_dapo.sandbox.pool import SandboxPool
from megatron_dapo.sandbox.types import ToolResult


class ToolLoadError(ValueError):
    """rollout.tools.name cannot be imported; the message is one line naming it."""


@dataclass
class Tool:
    submit: Callable[[str], Future[ToolResult]]
    close: Callable[[], None]


def make_tool(cfg: ToolsConfig) -> Tool:
    """python: the sandbox pool (SandboxUnavailable, one line, where it cannot start); module.path:function: that
    callable (code -> ToolResult) on `cfg.workers` threads, an exception in it an "error" result."""
    if cfg.name == "python":
        pool = SandboxPool(cfg.sandbox())
        return Tool(pool.submit, pool.close)
    fn = load_tool_fn(cfg.name)
    executor = ThreadPoolExecutor(max_workers=cfg.workers, thread_name_prefix="tool")
    return Tool(lambda code: executor.submit(_call, fn, code), executor.shutdown)


def load_tool_fn(name: str) -> Callable[[str], ToolResult]:
    module_name, _, fn_name = name.partition(":")
    fn = import_named(name, "rollout.tools.name", ToolLoadError)
    if not callable(fn):
        raise ToolLoadError(f"rollout.tools.name={name!r}: {module_name} has no callable {fn_name!r}")
    return fn


def _call(fn: Callable[[str], ToolResult], code: str) -> ToolResult:
    t0 = time.monotonic()
    try:
        result = fn(code)
    except Exception as e:  # the policy's code may break a user tool: an error the policy sees
        return ToolResult("error", "", f"{type(e).__name__}: {e}\n", round(time.monotonic() - t0, 4))
    if not isinstance(result, ToolResult):
        raise TypeError(f"tool {fn!r} returned {type(result).__name__}, expected sandbox.ToolResult")
    return result
