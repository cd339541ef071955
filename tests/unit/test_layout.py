"""The package's house rules (issue 44, docs/layout.md): at most 8 modules at the root, no import
circle between its modules, no module over 600 lines, ``train.py`` at most 100 lines, and one
module that touches Megatron's ``parallel_state``. Read from the source (ast), not imported."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "megatron_p3o"


def _modules(root=ROOT):
    mods = {}
    for f in (root / "megatron_p3o").rglob("*.py"):
        parts = list(f.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = f
    return mods


def _imports(mods):
    """``module -> modules of the package it imports`` (at any depth of the file: lazy imports
    inside functions count, they still tie the two modules together)."""

    def owner(name):
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    edges = {}
    for m, f in mods.items():
        pkg = m if f.name == "__init__.py" else m.rpartition(".")[0]
        out = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                names = [f"{base}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            out |= {owner(n) for n in names if n.startswith("megatron_p3o")}
        edges[m] = out - {m, ""}
    return edges


def test_at_most_eight_modules_at_the_root():
    root = sorted(p.name for p in PKG.glob("*.py"))
    assert len(root) <= 8, root


def test_no_import_circle():
    edges = _imports(_modules())
    index, low, stack, on, circles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    assert not circles, circles


def test_no_module_over_600_lines_and_a_short_train_py():
    long = {m: n for m, f in _modules().items() if (n := len(f.read_text().splitlines())) > 600}
    assert not long, long
    assert len((PKG / "train.py").read_text().splitlines()) <= 100


def test_one_module_touches_parallel_state():
    touching = sorted(
        str(f.relative_to(ROOT)) for f in PKG.rglob("*.py") if "parallel_state" in f.read_text()
    )
    assert touching == ["megatron_p3o/runtime/parallel.py"], touching


def test_the_checker_sees_a_circle(tmp_path):
    """The circle check can fail: two modules importing each other (one lazily) are found."""
    pkg = tmp_path / "megatron_p3o"
    (pkg / "a").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("")
    (pkg / "a" / "x.py").write_text("from megatron_p3o.a import y\n")
    (pkg / "a" / "y.py").write_text("def f():\n    from . import x\n")
    edges = _imports(_modules(tmp_path))
    assert edges["megatron_p3o.a.x"] == {"megatron_p3o.a.y"}
    assert edges["megatron_p3o.a.y"] == {"megatron_p3o.a.x"}


COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
    "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
    "barrier", "send", "recv", "send_object_list", "recv_object_list", "all_to_all", "reduce",
    "gather", "scatter", "isend", "irecv", "batch_isend_irecv", "all_to_all_single",
}  # fmt: skip


def test_every_collective_goes_through_the_named_helpers():
    """``torch.distributed`` collectives only in runtime/collectives.py, whose helpers all take
    the group (no default: never the implicit world) and the reason."""
    import inspect

    from megatron_p3o.runtime import collectives

    raw = []
    for f in PKG.rglob("*.py"):
        if f.name == "collectives.py" and f.parent.name == "runtime":
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            fn = node.func if isinstance(node, ast.Call) else None
            if (
                isinstance(fn, ast.Attribute)
                and fn.attr in COLLECTIVES
                and isinstance(fn.value, ast.Name)
                and fn.value.id == "dist"
            ):
                raw.append(f"{f.relative_to(ROOT)}:{node.lineno} dist.{fn.attr}")
    assert not raw, raw
    helpers = [
        (n, f) for n, f in vars(collectives).items()
        if inspect.isfunction(f) and not n.startswith("_") and f.__module__ == collectives.__name__
    ]  # fmt: skip
    assert len(helpers) >= 10
    for name, f in helpers:
        params = inspect.signature(f).parameters
        assert "group" in params and params["group"].default is inspect.Parameter.empty, name
        assert "why" in params and params["why"].default is inspect.Parameter.empty, name
