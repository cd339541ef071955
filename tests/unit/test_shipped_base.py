"""The base models shipped in ``bases/``: their bytes match ``SHA256SUMS``, a changed or extra
file is refused naming it, and the weights load in transformers as the recipe's architecture."""

import hashlib
import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

from shipped_base import BASES, verify  # noqa: E402

from megatron_p3o.runtime.errors import InputFileError  # noqa: E402


def test_every_shipped_file_matches_its_sum():
    lines = (BASES / "SHA256SUMS").read_text().split("\n")
    listed = {}
    for line in filter(None, lines):
        digest, name = line.split("  ", 1)  # sha256sum's own format, checkable with sha256sum -c
        listed[name] = digest
    files = {str(p.relative_to(BASES)) for p in BASES.rglob("*") if p.is_file()}
    assert files - {"SHA256SUMS"} == set(listed)
    for name, digest in listed.items():
        assert hashlib.sha256((BASES / name).read_bytes()).hexdigest() == digest, name
    assert "tiny_addition/hf/model.safetensors" in listed
    verify("tiny_addition")


def test_a_changed_or_extra_file_is_refused(tmp_path):
    root = tmp_path / "bases"
    shutil.copytree(BASES, root)
    w = root / "tiny_addition/hf/model.safetensors"
    data = bytearray(w.read_bytes())
    data[-1] ^= 1
    w.write_bytes(bytes(data))
    with pytest.raises(InputFileError, match="model.safetensors: sha256 .* does not match"):
        verify("tiny_addition", root)
    shutil.copy(BASES / "tiny_addition/hf/model.safetensors", w)
    verify("tiny_addition", root)
    (root / "tiny_addition/hf/extra.bin").write_bytes(b"x")
    with pytest.raises(InputFileError, match="extra.bin: not listed"):
        verify("tiny_addition", root)
    with pytest.raises(InputFileError, match="no shipped base named 'nope'"):
        verify("nope", root)


def test_the_tiny_base_loads_in_transformers_as_the_recipe_model():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = BASES / "tiny_addition/hf"
    model = AutoModelForCausalLM.from_pretrained(hf, torch_dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(hf)
    c = model.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads) == (64, 2, 4)
    assert c.vocab_size == len(tok) and not c.tie_word_embeddings
    from make_tiny_base import greedy_accuracy

    from megatron_p3o.data.tasks.arithmetic import splits

    _, held = splits(seed=0)
    acc = greedy_accuracy(model, tok, held)  # the 500 held-out prompts base.json was measured on
    shipped = json.loads((BASES / "tiny_addition/base.json").read_text())["heldout_greedy_acc"]
    assert abs(acc - shipped) <= 0.03, (acc, shipped)  # another CPU may flip a few argmaxes


def test_the_chain_base_loads_and_a_training_option_needs_train(tmp_path):
    import subprocess

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(BASES / "chain_sum/hf")
    info = json.loads((BASES / "chain_sum/base.json").read_text())
    assert info["task"] == "reasoning_gym:chain_sum" and info["heldout_greedy_acc"] >= 0.4
    assert model.config.num_hidden_layers == 4
    r = subprocess.run(
        [sys.executable, str(ROOT / "tools/make_base.py"), "--task", "chain_sum", "--out",
         str(tmp_path / "b"), "--seed", "3"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2 and "add --train" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "b").exists()
