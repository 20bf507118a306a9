"""megatron-dapo: DAPO RL on a Megatron-core actor with SGLang rollouts."""

__version__ = "0.1.0"

import sys as _sys

from megatron_dapo.cli import quiet_imports as _quiet_imports
from megatron_dapo.cli import started_as_cli as _started_as_cli
from megatron_dapo.eager_fuser import install as _install_eager_fuser

_install_eager_fuser()

if _started_as_cli(_sys.orig_argv):  # our command lines only: a user's script keeps every warning
    _quiet_imports()
