"""Isolated execution of model-written Python (bubblewrap namespaces + resource limits), a pool that runs many
calls in parallel, and a client for a SandboxFusion-compatible service. The threat model: README "Tools"."""

from megatron_dapo.sandbox.local import check_sandbox, run_code
from megatron_dapo.sandbox.pool import SandboxPool
from megatron_dapo.sandbox.types import STATUSES, SandboxConfig, SandboxUnavailable, ToolResult

__all__ = ["SandboxConfig", "ToolResult", "SandboxUnavailable", "STATUSES", "run_code", "check_sandbox",
           "SandboxPool"]
