"""spmd_rlhf: PyTorch-native RLHF in the HybridFlow design, launched with plain torchrun."""

from setuptools import find_packages, setup

setup(
    name="spmd_rlhf",
    version="0.1.0",
    description="PyTorch-native RLHF / RL fine-tuning of LLMs in the HybridFlow design (torchrun, no Ray)",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages("src") + ["spmd_rlhf.recipes", "spmd_rlhf.kernels"],
    package_dir={"": "src", "spmd_rlhf.recipes": "recipes", "spmd_rlhf.kernels": "kernels"},
    package_data={"spmd_rlhf.recipes": ["configs/*.yaml"]},
    install_requires=[
        "torch>=2.11,<2.16",
        "transformers>=4.51",
        "tokenizers>=0.21",
        "safetensors>=0.4",
        "numpy>=1.26",
        "omegaconf>=2.3",
        "pyarrow>=15",
    ],
    extras_require={
        # triton: the kernels run under its CPU interpreter in the tests (3.7-3.9 checked; with numpy >= 2.4 older
        # interpreters are broken and those tests skip), and >= 3.5 leaves a GPU image's torch-pinned triton alone;
        # trl: the GPU benchmarks' TRL baseline is smoke-tested on CPU; peft: LoRA parity and export round trips.
        "test": [
            "pytest>=8",
            "pytest-timeout>=2.3",
            "pytest-xdist>=3.5",
            "matplotlib>=3.8",
            "tensorboard>=2.16",
            "wandb>=0.17",
            "trl>=1.16,<2",
            "peft>=0.17",
            "triton>=3.5,<3.10; platform_system == 'Linux' and platform_machine == 'x86_64'",
        ],
        "gpu": ["flash-attn>=2.6"],
        "kernels": ["triton>=3.2"],
        "logging": ["tensorboard>=2.16", "wandb>=0.17", "matplotlib>=3.8"],
        "bench": ["trl>=1.16,<2"],
    },
    entry_points={"console_scripts": ["spmd-rlhf=spmd_rlhf.cli:main"]},
)
