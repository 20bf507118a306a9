"""Start the configured SGLang servers: one `SGLangEngine`, or several behind an `EngineGroup`."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from pathlib import Path
from typing import Any

from megatron_dapo.config import SGLangConfig
from megatron_dapo.rollout.base import RolloutEngine
from megatron_dapo.rollout.engine_group import EngineGroup
from megatron_dapo.rollout.sglang_engine import SGLangEngine


def launch_servers(model_path: str | Path, cfg: SGLangConfig, **engine_kwargs: Any) -> RolloutEngine:
    """cfg.num_servers servers (server k: port base_port + k, devices from k*TP), started together.

    The processes are spawned from the calling thread (their parent-death signal follows it) and
    waited for in parallel. If any fails to start, all are stopped and the first failure (in server
    order) is raised. `engine_kwargs` go to every `SGLangEngine` (bucket_mb, dtype, device, log_dir...).
    """
    if cfg.num_servers == 1:
        return SGLangEngine(model_path, cfg, **engine_kwargs)
    engines: list[SGLangEngine] = []
    try:
        for k in range(cfg.num_servers):
            engines.append(SGLangEngine(model_path, cfg, server_index=k, wait=False, **engine_kwargs))
        with ThreadPoolExecutor(max_workers=len(engines)) as pool:
            futures = [pool.submit(e.wait_ready) for e in engines]
        for fut in futures:
            fut.result()
    except BaseException:
        for engine in engines:
            with suppress(Exception):
                engine.shutdown()
        raise
    return EngineGroup(engines)
