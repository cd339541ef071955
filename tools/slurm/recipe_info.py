"""Shell variables for tools/slurm/p3o.sbatch from a recipe (after its --set overrides):
WORLD (training GPUs), SGL_TP (SGLang tensor parallel size), MODEL_HF (the HF directory next to
the converted checkpoint, which the SGLang servers load), SGL_ARGS (shared server arguments) and
RUN_DIR (the run directory; the script writes its server logs under RUN_DIR/logs)."""

import shlex
import sys
from dataclasses import replace
from pathlib import Path

from megatron_p3o.config import load_config
from megatron_p3o.rollout.sglang.launch import server_args


def main(argv):
    recipe, rest = argv[0], argv[1:]
    sets = [rest[i + 1] for i in range(len(rest) - 1) if rest[i] == "--set"]
    c = load_config(recipe, sets)
    if c.parallel.world_size is None:
        sys.exit(
            f"{recipe}: set parallel.world_size (the training GPU count) for the cluster script"
        )
    print(f"WORLD={c.parallel.world_size}")
    print(f"SGL_TP={c.rollout.sglang.tp_size}")
    print(f"MODEL_HF={shlex.quote(c.rollout.sglang.model_path or c.model.checkpoint + '/hf')}")
    sg = c.rollout.sglang
    if sg.device == "auto":  # the script serves on the job's GPUs, wherever this runs
        sg = replace(sg, device="cuda")
    print(f"SGL_ARGS={shlex.quote(' '.join(server_args(sg)))}")
    print(f"RUN_DIR={shlex.quote(str(Path(c.run.dir) / c.run.name))}")


if __name__ == "__main__":
    main(sys.argv[1:])
