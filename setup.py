"""megatron-p3o: Megatron-scale RL post-training with the P3O objective."""

from setuptools import find_packages, setup

setup(
    name="megatron-p3o",
    version="0.1.0",
    description="Megatron-Core RL post-training for P3O (and baselines) with SGLang rollouts",
    python_requires=">=3.10",
    packages=find_packages(
        include=["megatron_p3o", "megatron_p3o.*", "checkpoints_convert", "checkpoints_convert.*"]
    ),
    install_requires=[
        # A range: clusters bring their own CUDA build. CPU machines pin 2.13.0 via
        # constraints-cpu.txt so nothing pulls a CUDA wheel.
        "torch>=2.6,<2.15",
        # 0.16.1 is the newest for Python 3.11 and the version tested on CPU; 0.17+ needs 3.12.
        # Version-specific calls live in megatron_p3o/runtime/mcore_compat.py.
        "megatron-core==0.16.1; python_version < '3.12'",
        "megatron-core>=0.16.1,<0.20; python_version >= '3.12'",
        "psutil",  # without it a dist_checkpointing save hangs forever
        "pyyaml",
        "safetensors",
        "transformers>=4.51",
        "numpy",
        "rich",
        "matplotlib",  # stress-report plots
        # the stress tool's statistics (t intervals and tests, TOST, Holm, power: scipy.stats and
        # statsmodels; megatron_p3o/stress/stats.py and sequential.py)
        "scipy",
        "statsmodels",
        "packaging",
        # math answer rewards (its LaTeX parser needs antlr4 4.13, pinned in the lock file)
        "math-verify",
        "datasets",  # prompt files (jsonl, parquet)
        "tensorboard",  # scalars next to metrics.jsonl
    ],
    extras_require={
        # GPU clusters only. NVIDIA apex is optional and built from source; never the PyPI 'apex'.
        "gpu": ["transformer-engine[pytorch]"],
        # SGLang pins its own torch (2.14.1) and transformers: install it in a separate
        # environment (README: two environments); the trainer only talks to it over HTTP/NCCL.
        "sglang": ["sglang==0.5.23", "sglang-router==0.3.2"],
        # reasoning-gym's procedural tasks and verifiers (data.task: reasoning_gym:<name>)
        "tasks": ["reasoning-gym==0.1.25"],
        # Weights & Biases logging (off by default; tests use its offline mode)
        "wandb": ["wandb"],
        # accelerate: transformers' FP8 checkpoint loader needs it (the FP8 export's test);
        # pytest-xdist: tools/run_tests.sh runs the suite's files on 2 workers; pytest-timeout:
        # a test that hangs fails with its stacks (pytest.ini) instead of holding CI to its limit
        # bring your own agent (rollout.multi_turn.agent): the OpenAI client the agent is given
        # and the endpoint it talks to (docs/agents.md)
        "agents": ["openai", "aiohttp", "mcp"],
        "dev": [
            "pytest>=8",
            "pytest-xdist",
            "pytest-timeout",
            "ruff",
            "wandb",
            "accelerate",
            "openai",
            "aiohttp",
            "mcp",
        ],
    },
)
