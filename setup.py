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
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_dapo", "megatron_dapo.*"]),
    install_requires=[
        # Install torch first (`pip install torch==2.13.0` is a local CPU wheel here); any >= 2.6 works.
        "torch>=2.6",
        "megatron-core>=0.16",
        "transformers>=5.0",
        "safetensors",
        "tensorboard",
        "numpy",
        "pyarrow",
        "pyyaml",
        "psutil",  # megatron-core's checkpoint writer needs it; without it a save hangs
        "tqdm",
        "matplotlib",
    ],
    extras_require={
        # triton: the kernel tests run the Triton kernels in its CPU interpreter
        "dev": ["pytest>=8", "hypothesis>=6", "pytest-timeout", "triton>=3.1"],
        "triton": ["triton>=3.1"],
        # CUDA only; they pin their own torch/CUDA stacks. Never install PyPI's `apex` (unrelated).
        "gpu": ["transformer-engine[pytorch]", "sglang>=0.5"],
    },
    entry_points={"console_scripts": ["megatron-dapo-config=megatron_dapo.config:main"]},
)
