"""The tiny MoE recipe through torchrun at EP=2: rollouts record each token's experts, the
trainer replays them (R3) or routes by itself, and the route agreement is measured. The base is
a randomly initialised Qwen3-MoE in the task's tokenizer (the learning run is in the README)."""

import json
import subprocess
import sys

import pytest

from .cli import ENV, ROOT, torchrun


def _run(base, tmp_path, name, *sets, nproc=2, steps=2):
    args = {
        "model.checkpoint": base / "ckpt", "data.path": base / "train.jsonl",
        "data.eval_path": base / "heldout.jsonl", "data.eval_every": 0, "steps": steps,
        "batch.prompts_per_rollout": 8, "run.dir": tmp_path, "run.name": name,
    }  # fmt: skip
    launch = [*torchrun(nproc)] if nproc > 1 else [sys.executable]
    cmd = [*launch, "-m", "megatron_p3o.train", str(ROOT / "recipes/tiny_moe_cpu.yaml")]
    for k, v in args.items():
        cmd += ["--set", f"{k}={v}"]
    for s in sets:
        cmd += ["--set", s]
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines], r.stdout


@pytest.mark.e2e
def test_moe_ep2_with_and_without_routing_replay(moe_base, tmp_path):
    r3, _ = _run(moe_base, tmp_path, "r3", "optim.distributed_optimizer=true")
    off, _ = _run(
        moe_base, tmp_path, "no_replay", "rollout.routing_replay=off", "rollout.precision=fp32"
    )
    for m in r3 + off:
        for k in ("route_agreement", "route_agreement_l0", "route_agreement_l1"):
            assert 0.0 < m[k] <= 1.0, (k, m.get(k))
        assert m["loss"] == m["loss"]
    # an fp32 engine routes as the fp32 trainer does (ties aside); bf16 rollouts disagree more
    assert min(m["route_agreement"] for m in off) > 0.99
    assert min(m["route_agreement"] for m in r3) < min(m["route_agreement"] for m in off)
    _exports_to_transformers(moe_base, tmp_path / "r3", tmp_path / "r3_hf")
    # resume at another EP: the EP=2 run (distributed optimizer, expert-sharded state) goes on
    # in one process at EP=1
    more, out = _run(moe_base, tmp_path, "r3", "optim.distributed_optimizer=true",
                     "parallel.ep=1", "parallel.world_size=null", nproc=1, steps=3)  # fmt: skip
    assert "resumed from" in out and [m["step"] for m in more] == [1, 2, 3]


def _exports_to_transformers(base, run, out):
    """The EP=2 run's trained checkpoint (distributed optimizer, experts sharded) exports to an
    HF Qwen3-MoE that transformers loads, with the logits of Megatron's forward of the same
    checkpoint, and weights that training moved away from the base's."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    r = subprocess.run(
        [sys.executable, "-m", "checkpoints_convert.megatron_to_hf", "--ckpt", str(run),
         "--out", str(out)], capture_output=True, text=True, env=ENV, cwd=out.parent,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert model.config.num_experts == 4
    trained = load_file(str(next(out.glob("*.safetensors"))))
    start = load_file(str(next((base / "hf").glob("*.safetensors"))))
    assert set(trained) == set(start)
    assert max(float((trained[k] - start[k].float()).abs().max()) for k in start) > 1e-6
    r = subprocess.run(
        [sys.executable, "-m", "checkpoints_convert.verify", "--hf", str(out), "--ckpt",
         str(run), "--seq", "16"], capture_output=True, text=True, env=ENV, cwd=out.parent,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(r.stdout[r.stdout.index("{") :])
    assert rep["max_abs_logit_diff"] < 1e-4 and rep["mean_kl"] < 1e-8, rep
