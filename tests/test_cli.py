"""megatron_dapo.cli: one-line user errors with exit codes, and the one log-quieting function."""

import logging
import warnings
from typing import Any

import pytest

from megatron_dapo.cli import UserError, preflight_error, quiet_third_party, run_cli


class OtherError(ValueError):
    pass


def _raising(exc):
    def main(argv):
        raise exc

    return main


@pytest.fixture
def single_rank(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)


def test_user_errors_are_one_line_with_exit_2(single_rank, capsys):
    assert run_cli("prog", lambda argv: 0) == 0
    assert run_cli("prog", lambda argv: 1) == 1
    assert run_cli("prog", _raising(UserError("--save x is not empty"))) == 2
    assert capsys.readouterr().err == "prog: error: --save x is not empty\n"
    assert run_cli("prog", _raising(OtherError("bad header")), user_errors=(OtherError,)) == 2
    assert capsys.readouterr().err == "prog: error: bad header\n"
    with pytest.raises(OtherError):  # not declared a user error: a bug keeps its traceback
        run_cli("prog", _raising(OtherError("bug")))
    assert run_cli("prog", _raising(KeyboardInterrupt())) == 130
    assert capsys.readouterr().err == "prog: interrupted\n"


def test_main_gets_argv(single_rank):
    seen: list[Any] = []
    run_cli("prog", lambda argv: seen.append(argv) or 0, ["--x", "1"])  # type: ignore[func-returns-value]
    assert seen == [["--x", "1"]]


@pytest.mark.parametrize("rank", [0, 1])
def test_ranks_print_errors_once(monkeypatch, capsys, rank):
    """An input error every rank hits is printed by rank 0 only; a rank's own error by that rank, prefixed."""
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert run_cli("prog", _raising(preflight_error(UserError("same everywhere")))) == 2
    assert capsys.readouterr().err == ("prog: error: same everywhere\n" if rank == 0 else "")
    assert run_cli("prog", _raising(UserError("mine"))) == 2
    assert capsys.readouterr().err == f"prog: error: [rank {rank}] mine\n"


def test_quiet_third_party():
    from transformers.utils import logging as hf_logging

    loggers = {n: logging.getLogger(n).level for n in ("megatron", "megatron.core", "matplotlib")}
    bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            quiet_third_party()
            warnings.warn("Apex is not installed. Falling back to Torch Norm", UserWarning)
            warnings.warn("Transformer Engine is not installed", UserWarning)
            warnings.warn("cuda_graph_scope is deprecated", UserWarning)
            warnings.warn("deprecated", FutureWarning)
            warnings.warn("kept", UserWarning)
        assert [str(w.message) for w in caught] == ["kept"]
        assert logging.getLogger("megatron.core").getEffectiveLevel() == logging.ERROR
        assert logging.getLogger("megatron.core.distributed").getEffectiveLevel() == logging.ERROR
        assert logging.getLogger("matplotlib").level == logging.WARNING
        assert not hf_logging.is_progress_bar_enabled()
    finally:
        for name, level in loggers.items():
            logging.getLogger(name).setLevel(level)
        (hf_logging.enable_progress_bar if bars else hf_logging.disable_progress_bar)()
        hf_logging.set_verbosity(verbosity)


REPO = __import__("pathlib").Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("argv, ours", [
    (["python", "-m", "megatron_dapo.train", "--config", "x.yaml"], True),
    (["python", "-u", "-W", "ignore", "-m", "megatron_dapo.evaluate"], True),  # torchrun's workers: -u -m
    (["python", "-mmegatron_dapo.plan"], True),
    (["python", str(REPO / "tools" / "convert_hf_to_megatron.py"), "--hf-dir", "x"], True),
    (["python", "-m", "pytest", "-q"], False),
    (["python", "my_script.py"], False),
    (["python", "-c", "import megatron_dapo"], False),
    (["python"], False),
])
def test_started_as_cli(argv, ours):
    from megatron_dapo.cli import started_as_cli

    assert started_as_cli(argv) is ours


def test_quiet_imports_reaches_the_processes_started(monkeypatch):
    """Spawned workers import megatron-core again: the filter goes to
    them through PYTHONWARNINGS, added once to what the user set."""
    from megatron_dapo.cli import IMPORT_NOISE, quiet_imports

    monkeypatch.setenv("PYTHONWARNINGS", "error::ResourceWarning")
    for name in ("megatron", "megatron.core"):
        monkeypatch.setattr(logging.getLogger(name), "level", logging.getLogger(name).level)
    with warnings.catch_warnings():
        quiet_imports()
        quiet_imports()
    import os

    assert os.environ["PYTHONWARNINGS"] == f"error::ResourceWarning,ignore:{IMPORT_NOISE}"
