"""The tiny MoE recipe through torchrun at EP=2: rollouts record each token's experts, the
trainer replays them (R3) or routes by itself, and the route agreement is measured. The base is
a randomly initialised Qwen3-MoE in the task's tokenizer (the learning run is in the README)."""

import json
import subprocess
import sys

import pytest

from .cli import ENV, ROOT, torchrun


@pytest.fixture(scope="module")
def moe_base(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe") / "base"
    code = f"""
import sys, torch
sys.path.insert(0, {str(ROOT)!r})
from pathlib import Path
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from megatron_p3o.tasks.arithmetic import make_tokenizer, splits, write_jsonl
out = Path({str(out)!r})
tok = make_tokenizer(out / "hf")
train, held = splits(seed=0)
write_jsonl(train, out / "train.jsonl")
write_jsonl(held[:64], out / "heldout.jsonl")
torch.manual_seed(0)
cfg = Qwen3MoeConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
    max_position_embeddings=32, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
Qwen3MoeForCausalLM(cfg).save_pretrained(out / "hf")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run(
        [sys.executable, "-m", "checkpoints_convert.hf_to_megatron", "--hf", str(out / "hf"),
         "--out", str(out / "ckpt")], capture_output=True, text=True, env=ENV, cwd=ROOT,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return out


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
    # resume at another EP: the EP=2 run (distributed optimizer, expert-sharded state) goes on
    # in one process at EP=1
    more, out = _run(moe_base, tmp_path, "r3", "optim.distributed_optimizer=true",
                     "parallel.ep=1", "parallel.world_size=null", nproc=1, steps=3)  # fmt: skip
    assert "resumed from" in out and [m["step"] for m in more] == [1, 2, 3]
