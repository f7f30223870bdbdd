from setuptools import find_packages, setup

setup(
    name="sbpflow",
    version="0.1.0",
    description="Global tensors with SBP (split / broadcast / partial-sum) layouts for PyTorch",
    packages=find_packages(include=["sbpflow*", "sbpflow_kernels*"]),
    package_data={"sbpflow": ["py.typed"]},
    python_requires=">=3.10",
    install_requires=["torch>=2.11", "networkx>=3", "scipy>=1.9"],
    extras_require={
        # CuPy and NCCL wheels are built per CUDA major version: pick the one of your torch
        # build (torch.version.cuda). "cuda" is the CUDA 12 set.
        "cuda": ["cupy-cuda12x", "nvidia-nccl-cu12"],
        "cuda12": ["cupy-cuda12x", "nvidia-nccl-cu12"],
        "cuda13": ["cupy-cuda13x", "nvidia-nccl-cu13"],
        "examples": ["scikit-learn", "tqdm"],
        "notebook": ["matplotlib", "nbclient", "nbformat", "ipykernel"],
        "test": [
            "pytest>=7",
            "numpy",
            "nbclient",
            "nbformat",
            "ipykernel",
            "matplotlib",
            "transformers>=5",
            "scikit-learn",
            "tqdm",
            "safetensors",
        ],
    },
)
