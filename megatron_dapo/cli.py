"""What every command-line entry point shares: quiet third-party logs and one-line user errors.

    sys.exit(run_cli("convert_x", main, user_errors=(UserError, HFCheckpointError)))

A user error (bad input, a refused action) prints `prog: error: <one line>` on stderr and exits 2,
without a traceback; Ctrl-C prints `prog: interrupted` and exits 130. Anything else is a bug and keeps
its traceback.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

EXIT_USER_ERROR, EXIT_INTERRUPTED = 2, 130


class UserError(Exception):
    """Bad input or a refused action: printed as one line, exit code 2, no traceback."""


def preflight_error(e: Exception) -> Exception:
    """Mark an error every rank hits identically (checks of the inputs): only rank 0 prints it."""
    setattr(e, "same_on_all_ranks", True)
    return e


def run_cli(prog: str, main: Callable[[list[str] | None], int], argv: list[str] | None = None, *,
            user_errors: tuple[type[BaseException], ...] = ()) -> int:
    """Run `main(argv)`; UserError and `user_errors` become `prog: error: ...` on stderr and exit code 2.

    In a multi-rank run an error that only some ranks hit is printed by each of them, prefixed with
    its rank; one marked by `preflight_error` only by rank 0.
    """
    caught: tuple[type[BaseException], ...] = (UserError, *user_errors)
    try:
        return main(argv)
    except caught as e:
        print_error(prog, e)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def print_error(prog: str, e: BaseException | str, *, kind: str = "error", same_on_all_ranks: bool = False) -> None:
    """`prog: kind: message` on stderr, as ONE line (later lines of a message are joined). An error every
    rank hits alike (`preflight_error`, or `same_on_all_ranks`) is printed by rank 0 only; others by
    each rank that hits it, prefixed with its rank."""
    same = same_on_all_ranks or getattr(e, "same_on_all_ranks", False)
    rank, world = _env_int("RANK", "SLURM_PROCID", 0), _env_int("WORLD_SIZE", "SLURM_NTASKS", 1)
    if rank == 0 or not same:
        prefix = f"[rank {rank}] " if world > 1 and not same else ""
        text = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
        print(f"{prog}: {kind}: {prefix}{text}", file=sys.stderr, flush=True)


def _env_int(name: str, fallback: str, default: int) -> int:
    return int(os.environ.get(name, os.environ.get(fallback, default)))


IMPORT_NOISE = "Transformer Engine and Apex are not installed"
"""How megatron-core's import-time warnings begin on a machine without TE / apex (eight lines, in every
process that imports it); the start-up summary says which kernels run instead."""
_TOOLS = Path(__file__).resolve().parents[1] / "tools"


def started_as_cli(argv: list[str]) -> bool:
    """Whether `argv` (the interpreter's own, sys.orig_argv) runs one of our command lines: `python [opts] -m
    megatron_dapo...` or a script in the repository's tools/. Not a user's script, pytest or `python -c`."""
    args = iter(argv[1:])
    for arg in args:
        if arg == "-m" or (arg.startswith("-m") and not arg.startswith("--")):
            module = arg[2:] or next(args, "")
            return module.split(".")[0] == "megatron_dapo"
        if arg in ("-W", "-X"):  # an option with its value in the next argument
            next(args, None)
        elif arg == "-c" or arg == "-" or (arg.startswith("-c") and not arg.startswith("--")):
            return False
        elif not arg.startswith("-"):
            return Path(arg).resolve().parent == _TOOLS
    return False


def quiet_imports() -> None:
    """Silence megatron-core's import-time noise before it is imported (our command lines only: the package
    calls this when `started_as_cli`), here and in the processes this one starts (spawned workers:
    they import megatron-core again): they inherit PYTHONWARNINGS."""
    for name in ("megatron", "megatron.core"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*(Apex|apex|Transformer Engine).*")
    inherited = f"ignore:{IMPORT_NOISE}"
    current = os.environ.get("PYTHONWARNINGS", "")
    if inherited not in current.split(","):
        os.environ["PYTHONWARNINGS"] = f"{current},{inherited}" if current else inherited


def quiet_third_party() -> None:
    """Megatron logs every grad bucket at INFO and warns that apex/TE are absent (expected on CPU) and
    about deprecations; transformers draws progress bars. Keep their errors, drop the rest."""
    quiet_imports()
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*cuda_graph_scope.*")
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
