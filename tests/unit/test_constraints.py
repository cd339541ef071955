"""Issue 24, item 12: the cluster install is pinned to what is tested. constraints-gpu.txt pins
megatron-core to the version this machine tests (the installed one, also the CPU lock's) and
Transformer Engine to one release inside the range megatron-core itself declares (read from its
installed metadata), leaves torch and CUDA libraries to the container, and pins every
requirement of setup.py."""

import re
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]


def _pins(name: str) -> dict:
    pins = {}
    for line in (ROOT / name).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            pkg, ver = line.split("==")
            pins[pkg.lower().replace("_", "-")] = ver.strip()
    return pins


def test_gpu_lock_pins_the_tested_megatron_and_a_compatible_te():
    gpu, cpu = _pins("constraints-gpu.txt"), _pins("constraints-cpu.txt")
    assert gpu["megatron-core"] == cpu["megatron-core"] == metadata.version("megatron-core")
    te = {gpu[k] for k in gpu if k.startswith("transformer-engine")}
    assert len(te) == 1 and {"transformer-engine", "transformer-engine-torch"} <= set(gpu)
    declared = [
        Requirement(r.split(";")[0])
        for r in metadata.requires("megatron-core") or []
        if r.startswith("transformer-engine")
    ]
    assert declared, "megatron-core declares no Transformer Engine range"
    assert all(Version(next(iter(te))) in r.specifier for r in declared), (te, declared)
    assert not [k for k in gpu if k == "torch" or k.startswith("nvidia-") or k == "triton"]


def test_gpu_lock_pins_every_requirement_of_setup_py():
    gpu = _pins("constraints-gpu.txt")
    text = (ROOT / "setup.py").read_text()
    block = text[text.index("install_requires=[") : text.index("extras_require")]
    names = re.findall(r'^\s*"([A-Za-z0-9_.-]+)', block, re.M)
    reqs = {Requirement(n).name.lower() for n in names} - {"torch"}
    assert reqs and not reqs - set(gpu), sorted(reqs - set(gpu))
