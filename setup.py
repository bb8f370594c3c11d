"""magicserve: disaggregated prefill/decode serving with MagicDec-style speculative decoding."""

from setuptools import setup

PACKAGES = [
    "modeling",
    "modeling.attention",
    "prefill_worker",
    "decode_worker",
    "kv_transfer",
    "controller",
    "protos",
]

setup(
    name="magicserve",
    version="0.1.0",
    description="Disaggregated prefill/decode LLM serving with sparse-KV speculative decoding",
    python_requires=">=3.10",
    packages=PACKAGES,
    package_data={"protos": ["magicserve/v1/*.proto"]},
    install_requires=[
        "torch>=2.3",
        "ray>=2.9",
        "grpcio>=1.60",
        "protobuf>=4.25",
        "pyyaml>=6.0",
        "safetensors>=0.4",
        "tokenizers>=0.15",
        "tqdm>=4.60",
    ],
    extras_require={
        "gpu": ["flash-attn>=2.5"],
        "test": ["pytest>=7", "transformers>=4.43", "grpcio-tools>=1.60", "matplotlib>=3.5"],
    },
    entry_points={"console_scripts": ["magicserve=controller.cli:main"]},
)
