"""Install a base model shipped in ``bases/`` instead of training one.

Why ship them: a base model is the product of a few hundred SFT steps on the CPU's own kernels,
and another instruction set rounds differently — the chain base made on another CPU reached
0.058 held-out accuracy after 775 steps where this one reached 0.69 — so a stress study whose
cells start from "the base ``make_base.py`` makes" is not the same study on another machine.
The shipped weights (``bases/<name>/hf``, safetensors) are the same bytes everywhere; their
SHA-256 sums are in ``bases/SHA256SUMS`` (``sha256sum -c`` format) and are checked before use.

Installing copies ``hf/`` and ``base.json``, converts ``hf/`` into the Megatron checkpoint
``ckpt/`` (checkpoints_convert, TP=PP=1, float32: a copy of the same numbers) and writes the
task's data files when the task has them (the addition splits are Python's own ``random``, so
they are the same on every CPU).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from megatron_p3o.runtime.errors import InputFileError

# the shipped bases' model (chain_sum's and tool_calc's: make_base.py and tool_base.py)
MODEL = dict(
    hidden_size=128,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)

BASES = Path(__file__).resolve().parent.parent / "bases"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sums(root: Path = BASES) -> dict[str, str]:
    """``relative path -> sha256`` from ``SHA256SUMS``."""
    out = {}
    for line in (root / "SHA256SUMS").read_text().splitlines():
        if line.strip():
            digest, name = line.split(maxsplit=1)
            out[name.lstrip("*")] = digest
    return out


def verify(name: str, root: Path = BASES) -> dict[str, str]:
    """Check every file of ``bases/<name>`` against ``SHA256SUMS`` (and that none is unlisted);
    one-line ``InputFileError`` naming the file otherwise. Returns that base's sums."""
    listed = {k: v for k, v in sums(root).items() if k.startswith(f"{name}/")}
    if not listed:
        raise InputFileError(f"{root / 'SHA256SUMS'}: no shipped base named {name!r}")
    present = {str(p.relative_to(root)) for p in (root / name).rglob("*") if p.is_file()}
    extra = sorted(present - set(listed))
    if extra:
        raise InputFileError(f"{root / extra[0]}: not listed in {root / 'SHA256SUMS'}")
    for rel, digest in sorted(listed.items()):
        path = root / rel
        if not path.is_file():
            raise InputFileError(f"{path}: missing from the shipped base {name!r}")
        got = sha256(path)
        if got != digest:
            raise InputFileError(
                f"{path}: sha256 {got[:16]}… does not match SHA256SUMS ({digest[:16]}…); "
                "the shipped base was changed or damaged (git checkout bases/ restores it)"
            )
    return listed


def install(name: str, out: Path, root: Path = BASES) -> dict:
    """Install ``bases/<name>`` into ``out`` (``hf/``, ``ckpt/``, ``base.json``, data files);
    returns the base's ``base.json`` with ``shipped`` (its name) and ``weights_sha256``."""
    if out.exists() and not out.is_dir():
        raise InputFileError(f"--out {out} is a file; give a directory")
    if out.is_dir() and any(out.iterdir()):
        raise InputFileError(f"--out {out}: holds files but no base.json; give a new directory")
    listed = verify(name, root)
    src = root / name
    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    shutil.copytree(src / "hf", tmp / "hf")
    info = json.loads((src / "base.json").read_text())
    if info.get("task") == "addition":
        from megatron_p3o.data.tasks.arithmetic import splits, write_jsonl

        train, held = splits(seed=int(info.get("seed", 0)))
        write_jsonl(train, tmp / "train.jsonl")
        write_jsonl(held, tmp / "heldout.jsonl")
    if info.get("task") in ("tool_calc", "tool_code"):  # Python's own random: the same
        from megatron_p3o.data.tasks import tool_calc  # splits everywhere (tool_code's are these)

        train, held = tool_calc.splits()
        tool_calc.write_jsonl(train, tmp / "train.jsonl")
        tool_calc.write_jsonl(held, tmp / "heldout.jsonl")
    from checkpoints_convert.hf_to_megatron import convert
    from megatron_p3o.runtime.parallel import Layout, initialize

    convert(str(tmp / "hf"), str(tmp / "ckpt"), groups=initialize(Layout()), dtype="float32")
    info["shipped"] = name
    info["weights_sha256"] = listed[f"{name}/hf/model.safetensors"]
    (tmp / "base.json").write_text(json.dumps(info, indent=1) + "\n")
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.is_dir():
        out.rmdir()  # empty (checked above)
    tmp.rename(out)  # atomic: a half-installed base never looks installed
    return info
