"""Reading peer sources: cut functions and classes out of a peer file with ``ast`` and exec them
into scratch modules (see tools/record_peer_mismatch.py)."""

import ast
import subprocess
import sys
import types
from collections.abc import Callable
from pathlib import Path

# --------------------------------------------------------------------------------------------
# Reading peer sources
# --------------------------------------------------------------------------------------------


class PeerSource:
    """A peer repository read through git (bare mirror or checkout), pinned to one commit."""

    def __init__(self, spec: str, repo_name: str):
        path, _, rev = spec.partition("@")
        self.path = Path(path)
        self.repo = repo_name
        bare = (self.path / "objects").is_dir() and (self.path / "HEAD").is_file()
        self._git = ["git", f"--git-dir={self.path}"] if bare else ["git", "-C", str(self.path)]
        self.commit = self.git("rev-parse", f"{rev or 'HEAD'}^{{commit}}").strip()

    def git(self, *args: str) -> str:
        return subprocess.run(
            [*self._git, *args], check=True, capture_output=True, text=True
        ).stdout

    def read(self, relpath: str) -> str:
        return self.git("show", f"{self.commit}:{relpath}")


def new_module(name: str, **names) -> types.ModuleType:
    """A scratch module (registered in sys.modules, which dataclasses need) seeded with names."""
    mod = types.ModuleType(name)
    mod.__dict__.update(names)
    sys.modules[name] = mod
    return mod


def load_defs(
    src: PeerSource,
    relpath: str,
    names: list[str],
    mod: types.ModuleType,
    strip_decorators: tuple[str, ...] = (),
) -> dict[str, list[int]]:
    """Exec the named top-level defs/classes/assignments of a peer file into ``mod``.

    Annotations are compiled lazily (PEP 563) so that type-only imports need no stand-ins.
    Returns {name: [first_line, last_line]} in the peer file.
    """
    tree = ast.parse(src.read(relpath), filename=relpath)
    picked, spans = [], {}
    for node in tree.body:
        name = None
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = node.name
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            if isinstance(node.targets[0], ast.Name):
                name = node.targets[0].id
        if name not in names:
            continue
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        spans[name] = [first, node.end_lineno]
        if strip_decorators and hasattr(node, "decorator_list"):
            node.decorator_list = [
                d for d in node.decorator_list if ast.unparse(d) not in strip_decorators
            ]
        picked.append(node)
    missing = sorted(set(names) - set(spans))
    if missing:
        raise SystemExit(f"{src.repo}@{src.commit}:{relpath}: not found: {missing}")
    lazy = ast.ImportFrom(module="__future__", names=[ast.alias(name="annotations")], level=0)
    module = ast.fix_missing_locations(ast.Module(body=[lazy, *picked], type_ignores=[]))
    code = compile(module, f"{src.repo}@{src.commit[:12]}/{relpath}", "exec", dont_inherit=True)
    exec(code, mod.__dict__)
    return spans


def exec_whole(src: PeerSource, relpath: str, mod: types.ModuleType) -> None:
    """Exec a whole peer file (only for files whose imports are all stdlib)."""
    text = src.read(relpath)
    exec(compile(text, f"{src.repo}@{src.commit[:12]}/{relpath}", "exec"), mod.__dict__)


def class_defaults(src: PeerSource, relpath: str, class_name: str) -> dict:
    """Literal defaults of the annotated fields of a (pydantic/dataclass) config class."""
    tree = ast.parse(src.read(relpath))
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            out = {}
            for stmt in node.body:
                if isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
                    out[stmt.target.id] = ast.literal_eval(stmt.value)
            return out
    raise SystemExit(f"{relpath}: class {class_name} not found")


def _not_needed(name: str) -> Callable:
    def fail(*args, **kwargs):
        raise RuntimeError(f"stand-in {name} was called; the recorded path must not need it")

    return fail


def _def_record(src: PeerSource, file: str, function: str, spans: dict) -> dict:
    return {
        "repo": src.repo,
        "commit": src.commit,
        "file": file,
        "function": function,
        "loaded_defs": {k: v for k, v in spans.items()},
    }
