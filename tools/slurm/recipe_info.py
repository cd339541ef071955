"""Shell variables for tools/slurm/p3o.sbatch from a recipe (after its --set overrides):
WORLD (training GPUs), SGL_TP (SGLang tensor parallel size), MODEL_HF (the HF directory the
SGLang servers load), SGL_FP8 (1: FP8 serving, MODEL_HF must be a block-FP8 checkpoint), CKPT
(the trainer's checkpoint, from which the script makes that FP8 checkpoint when it is missing)
and RUN_DIR (the run directory; the script writes its server logs under RUN_DIR/logs).

A bad recipe (missing, unknown key, bad value) is one line on stderr, exit status 2, like
``megatron_p3o.train``: the batch script's ``eval "$(...)"`` must not swallow a traceback."""

import argparse
import shlex
from pathlib import Path

from megatron_p3o.config.loading import load_config
from megatron_p3o.rollout.sglang.launch import resolve_python
from megatron_p3o.runtime.errors import ConfigError, UserError, run_cli

PROG = "recipe_info.py"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("recipe")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--debug", action="store_true", help="show the traceback of user errors too")
    a = ap.parse_args(argv)
    c = load_config(a.recipe, a.set)
    if c.parallel.world_size is None:
        raise ConfigError(
            f"{a.recipe}: set parallel.world_size (the training GPU count) for the cluster script"
        )
    try:  # the servers run with SGLang's own interpreter: fail here, not on the rollout nodes
        resolve_python(c.rollout.sglang)
    except UserError as e:
        raise ConfigError(f"{a.recipe}: {e}") from None
    print(f"WORLD={c.parallel.world_size}")
    print(f"SGL_TP={c.rollout.sglang.tp_size}")
    print(f"MODEL_HF={shlex.quote(c.rollout.sglang.model_path or c.model.checkpoint + '/hf')}")
    print(f"SGL_FP8={int(c.rollout.sglang.quantization == 'fp8')}")
    print(f"CKPT={shlex.quote(c.model.checkpoint)}")
    print(f"RUN_DIR={shlex.quote(str(Path(c.run.dir) / c.run.name))}")
    return 0


if __name__ == "__main__":
    run_cli(main, PROG)
