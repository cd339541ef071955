"""A trained policy leaves the trainer (issue 41, item 1).

The checkpoint is one the trainer wrote at TP=2 × PP=2 (the ``trained_export`` fixture: torchrun,
4 ranks), exported with ``checkpoints_convert.megatron_to_hf --ckpt RUN_DIR`` from outside the
checkout. The export is judged by independent readers: ``transformers`` loads it; its logits
equal Megatron's forward of the same checkpoint (``checkpoints_convert.verify``: the project's
Megatron model built at TP=1 and loaded from the trained checkpoint); and its greedy held-out
accuracy, decoded by ``transformers.generate`` one prompt at a time, equals the accuracy the
trainer itself logged at that step (``eval.jsonl``: the embedded engine at the trainer's fp32).
"""

import json
import shutil
import subprocess
import sys

import pytest
import torch

from .cli import ENV

pytestmark = pytest.mark.e2e


def _cli(*args, cwd):
    r = subprocess.run([sys.executable, "-m", *map(str, args)], capture_output=True, text=True,
                       env=ENV, timeout=600, cwd=cwd)  # fmt: skip
    return r


def test_transformers_loads_it_with_the_trainers_logits(trained_export, base, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run, hf = trained_export
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    assert (
        model.config.vocab_size == json.loads((base / "hf/config.json").read_text())["vocab_size"]
    )
    # trained, not the base: two P3O steps moved the weights
    trained = load_file(str(next(hf.glob("*.safetensors"))))
    start = load_file(str(base / "hf/model.safetensors"))
    assert set(trained) == set(start)
    moved = max(float((trained[k].float() - start[k].float()).abs().max()) for k in start)
    assert moved > 1e-6, moved
    r = _cli("checkpoints_convert.verify", "--hf", hf, "--ckpt", run, "--seq", 16, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(r.stdout[r.stdout.index("{") :])
    assert rep["max_abs_logit_diff"] < 1e-4 and rep["mean_kl"] < 1e-8, rep


def test_its_greedy_accuracy_equals_the_trainers_evaluation(trained_export, base):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_p3o.data.prompts import all_rows
    from megatron_p3o.data.tasks.arithmetic import reward

    run, hf = trained_export
    rows = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
    logged = {r["step"]: r["eval/heldout_accuracy"] for r in rows if "eval/heldout_accuracy" in r}
    assert sorted(logged) == [0, 2], logged  # before training and at the exported step, once each
    tok = AutoTokenizer.from_pretrained(hf)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    recipe = json.loads((run / "config.json").read_text())
    max_new = recipe["rollout"]["sampling"]["max_new_tokens"]
    correct = []
    for ids, answer in all_rows(str(base / "heldout.jsonl"), tok):
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                do_sample=False,
                max_new_tokens=max_new,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )
        text = tok.decode(out[0, len(ids) :].tolist(), skip_special_tokens=True)
        correct.append(float(reward(text, answer)))
    acc = sum(correct) / len(correct)
    assert acc == pytest.approx(logged[2], abs=1e-12), (acc, logged)


def test_a_checkpoint_from_before_it_carried_its_description_exports(trained_export, tmp_path):
    """Checkpoints written before the trainer stored ``p3o_model.json`` and ``hf/`` export with
    the description and tokenizer of the checkpoint their recipe started from."""
    run, hf = trained_export
    old = tmp_path / "step_000002"
    shutil.copytree(run / "checkpoints/step_000002", old)
    (old / "p3o_model.json").unlink()
    shutil.rmtree(old / "hf")
    r = _cli("checkpoints_convert.megatron_to_hf", "--ckpt", old, "--out", tmp_path / "out",
             cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "model description and tokenizer from model.checkpoint=" in r.stdout
    from safetensors.torch import load_file

    a = load_file(str(next(hf.glob("*.safetensors"))))
    b = load_file(str(next((tmp_path / "out").glob("*.safetensors"))))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "out/tokenizer.json").is_file()


def test_a_run_directory_skips_a_damaged_newest_checkpoint(trained_export, tmp_path):
    """``--ckpt RUN_DIR`` takes the newest checkpoint that verifies against its manifest."""
    run, _ = trained_export
    copy = tmp_path / "run"
    (copy / "checkpoints").mkdir(parents=True)
    good = run / "checkpoints/step_000002"
    shutil.copytree(good, copy / "checkpoints/step_000001")
    shutil.copytree(good, copy / "checkpoints/step_000002")
    (copy / "checkpoints/latest").write_text("step_000002")
    shard = sorted((copy / "checkpoints/step_000002").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    r = _cli("checkpoints_convert.megatron_to_hf", "--ckpt", copy, "--out", tmp_path / "out",
             cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "step_000002 is damaged" in r.stdout and "using step_000001" in r.stdout
    assert (copy / "checkpoints/step_000002").is_dir()  # an export reads, never renames
    assert json.loads(r.stdout[r.stdout.index("{") :])["checkpoint"].endswith("step_000001")


def test_user_errors_of_the_export_are_one_line(tmp_path):
    r = _cli("checkpoints_convert.megatron_to_hf", "--ckpt", tmp_path / "nope", "--out",
             tmp_path / "o", cwd=tmp_path)  # fmt: skip
    assert r.returncode == 2 and "no such directory" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    (tmp_path / "empty/checkpoints").mkdir(parents=True)
    r = _cli("checkpoints_convert.megatron_to_hf", "--ckpt", tmp_path / "empty", "--out",
             tmp_path / "o", cwd=tmp_path)  # fmt: skip
    assert r.returncode == 2 and "without a checkpoint" in r.stderr, r.stderr
