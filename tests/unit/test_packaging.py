"""The wheel holds every module (issue 41, item 2).

``setup.py`` lists packages with ``find_packages``, which skips a folder without
``__init__.py``: a main whose ``megatron_p3o/rollout`` and ``megatron_p3o/hf`` had none built a
wheel without them, and every install path then was ``pip install -e`` (which reads the source
tree), so nothing noticed. ``tools/wheel_check.sh`` (run by ``tools/run_tests.sh``) builds and
installs the real wheel; this test is the quick guard.
"""

from __future__ import annotations

from pathlib import Path

from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ("megatron_p3o", "checkpoints_convert")


def _module_dirs():
    for top in SHIPPED:
        for d in sorted([ROOT / top, *(ROOT / top).rglob("*")]):
            if d.is_dir() and d.name != "__pycache__" and any(d.glob("*.py")):
                yield d


def test_every_module_folder_is_a_package():
    missing = [
        str(d.relative_to(ROOT)) for d in _module_dirs() if not (d / "__init__.py").is_file()
    ]
    assert not missing, (
        f"folders with modules but no __init__.py (left out of the wheel): {missing}"
    )


def test_find_packages_takes_every_module():
    found = set(find_packages(str(ROOT), include=[f"{t}*" for t in SHIPPED]))
    want = {".".join(d.relative_to(ROOT).parts) for d in _module_dirs()}
    assert want <= found, sorted(want - found)
    setup = (ROOT / "setup.py").read_text()
    for top in SHIPPED:
        assert f'"{top}.*"' in setup, f"setup.py does not include {top}'s subpackages"
