"""Shell variables for tools/slurm/p3o.sbatch from a recipe (after its --set overrides):
WORLD (training GPUs), SGL_TP (SGLang tensor parallel size), MODEL_HF (the HF directory the
SGLang servers load), SGL_FP8 (1: FP8 serving, MODEL_HF must be a block-FP8 checkpoint), CKPT
(the trainer's checkpoint, from which the script makes that FP8 checkpoint when it is missing)
and RUN_DIR (the run directory; the script writes its server logs under RUN_DIR/logs)."""

import shlex
import sys
from pathlib import Path

from megatron_p3o.config import load_config
from megatron_p3o.errors import UserError
from megatron_p3o.rollout.sglang.launch import resolve_python


def main(argv):
    recipe, rest = argv[0], argv[1:]
    sets = [rest[i + 1] for i in range(len(rest) - 1) if rest[i] == "--set"]
    c = load_config(recipe, sets)
    if c.parallel.world_size is None:
        sys.exit(
            f"{recipe}: set parallel.world_size (the training GPU count) for the cluster script"
        )
    try:  # the servers run with SGLang's own interpreter: fail here, not on the rollout nodes
        resolve_python(c.rollout.sglang)
    except UserError as e:
        sys.exit(f"{recipe}: {e}")
    print(f"WORLD={c.parallel.world_size}")
    print(f"SGL_TP={c.rollout.sglang.tp_size}")
    print(f"MODEL_HF={shlex.quote(c.rollout.sglang.model_path or c.model.checkpoint + '/hf')}")
    print(f"SGL_FP8={int(c.rollout.sglang.quantization == 'fp8')}")
    print(f"CKPT={shlex.quote(c.model.checkpoint)}")
    print(f"RUN_DIR={shlex.quote(str(Path(c.run.dir) / c.run.name))}")


if __name__ == "__main__":
    main(sys.argv[1:])
