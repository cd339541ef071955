"""The package's house rules (issue 44, docs/layout.md): at most 8 modules at the root, no import
circle between its modules nor between its stage folders (issue 53), no module over 600 lines,
``train.py`` at most 100 lines, and one module that touches Megatron's ``parallel_state``. Read
from the source (ast), not imported."""

import ast
from pathlib import Path
from typing import Dict, List, Tuple

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "megatron_p3o"


def _import_statements(f: Path, module: str):
    """``(line, dotted name)`` of every name an ``import`` / ``from … import`` statement of file
    ``f`` (module ``module``) reaches, at any depth: inside functions (lazy imports) and under
    ``if TYPE_CHECKING:`` too. Relative imports are resolved against the module's package."""
    pkg = module if f.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(f.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            yield node.lineno, name


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
        names = {n for _, n in _import_statements(f, m) if n.startswith("megatron_p3o")}
        edges[m] = {owner(n) for n in names} - {m, ""}
    return edges


def _stage_folders(root=ROOT) -> set:
    """The stage folders: the packages directly under ``megatron_p3o/`` (root modules such as
    ``trainer.py`` or ``types.py`` are not folders)."""
    pkg = root / "megatron_p3o"
    return {d.name for d in pkg.iterdir() if (d / "__init__.py").is_file()}


def _folder_imports(root=ROOT) -> Dict[Tuple[str, str], List[str]]:
    """``(folder A, folder B) -> ["file:line", …]``: every place a module under A imports
    anything under B (the name's top-level stage folder), sorted."""
    stages, edges = _stage_folders(root), {}
    for m, f in _modules(root).items():
        src = m.split(".")
        if len(src) < 2 or src[1] not in stages:
            continue  # the package itself or a root module
        for line, name in _import_statements(f, m):
            dst = name.split(".")
            if dst[0] == "megatron_p3o" and len(dst) > 1 and dst[1] in stages and dst[1] != src[1]:
                where = f"{f.relative_to(root)}:{line}"
                edges.setdefault((src[1], dst[1]), []).append(where)
    return {k: sorted(set(v), key=lambda w: (w.rsplit(":", 1)[0], int(w.rsplit(":", 1)[1])))
            for k, v in edges.items()}  # fmt: skip


def _cycles(edges) -> List[List[str]]:
    """The strongly connected components of more than one node (Tarjan) of ``node -> {nodes}``:
    every circle, two-node or longer, lies inside one of them."""
    index, low, stack, on, comps = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
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
                comps.append(sorted(comp))

    for v in sorted(set(edges) | {w for ws in edges.values() for w in ws}):
        if v not in index:
            visit(v)
    return sorted(comps)


def _folder_cycles(root=ROOT) -> List[str]:
    """One report per cycle between stage folders: its folders, each folder pair that imports
    both ways, and every edge inside it with one ``file:line`` to start from."""
    sites = _folder_imports(root)
    graph: Dict[str, set] = {}
    for a, b in sites:
        graph.setdefault(a, set()).add(b)
    out = []
    for comp in _cycles(graph):
        pairs = [f"{a} <-> {b}" for a in comp for b in comp if a < b and (a, b) in sites
                 and (b, a) in sites]  # fmt: skip
        lines = [f"cycle {' / '.join(comp)} ({', '.join(pairs) or 'no two-way pair'}):"]
        for a in comp:
            for b in comp:
                if (a, b) in sites:
                    more = len(sites[a, b]) - 1
                    tail = f" (+{more} more)" if more else ""
                    lines.append(f"  {a} -> {b}: {sites[a, b][0]}{tail}")
        out.append("\n".join(lines))
    return out


def test_at_most_eight_modules_at_the_root():
    root = sorted(p.name for p in PKG.glob("*.py"))
    assert len(root) <= 8, root


def test_no_import_circle():
    circles = _cycles(_imports(_modules()))
    assert not circles, circles


def test_no_import_cycle_between_stage_folders():
    """Issue 53: a folder that imports another is never imported back by it, lazy imports and
    ``TYPE_CHECKING`` imports included: a function that a lower folder needs from a higher one
    belongs lower (the shared style guide)."""
    cycles = _folder_cycles()
    assert not cycles, "import cycles between stage folders:\n" + "\n".join(cycles)


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


def test_the_checker_sees_a_folder_cycle(tmp_path):
    """The folder check can fail: a two-folder cycle through a lazy and a ``TYPE_CHECKING``
    relative import, and a three-folder one with no two-way pair, each edge named by file:line;
    root modules and one-way edges are no cycle."""
    pkg = tmp_path / "megatron_p3o"
    files = {
        "__init__.py": "",
        "trainer.py": "from megatron_p3o.a import x\n",  # a root module: not a folder
        "a/x.py": "import os\n\n\ndef f():\n    from megatron_p3o.b.y import g\n",
        "a/w.py": "from megatron_p3o import trainer\nfrom megatron_p3o.f import v\n",
        "b/y.py": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from ..a import x\n",
        "c/__init__.py": "import megatron_p3o.d.z\n",
        "d/z.py": "from megatron_p3o import e\n",
        "e/q.py": "from ..c import s\n",
        "c/s.py": "",
        "f/v.py": "",
    }
    for name, text in files.items():
        f = pkg / name
        f.parent.mkdir(parents=True, exist_ok=True)
        (f.parent / "__init__.py").touch()
        f.write_text(text)
    assert _stage_folders(tmp_path) == {"a", "b", "c", "d", "e", "f"}
    sites = _folder_imports(tmp_path)
    assert sites[("a", "b")] == ["megatron_p3o/a/x.py:5"]
    assert sites[("b", "a")] == ["megatron_p3o/b/y.py:4"]
    assert sites[("a", "f")] == ["megatron_p3o/a/w.py:2"]
    cycles = _folder_cycles(tmp_path)
    assert cycles == [
        "cycle a / b (a <-> b):\n  a -> b: megatron_p3o/a/x.py:5\n  b -> a: megatron_p3o/b/y.py:4",
        "cycle c / d / e (no two-way pair):\n  c -> d: megatron_p3o/c/__init__.py:1\n"
        "  d -> e: megatron_p3o/d/z.py:1\n  e -> c: megatron_p3o/e/q.py:1",
    ], cycles


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


def _script_cycles(folder: Path) -> List[List[str]]:
    """Import circles among a folder's scripts, which import each other by bare module name
    (the script's folder is on ``sys.path``): lazy imports count."""
    mods = {f.stem: f for f in folder.glob("*.py")}
    edges = {}
    for m, f in mods.items():
        tops = {n.split(".")[0] for _, n in _import_statements(f, m)}
        edges[m] = {t for t in tops if t in mods} - {m}
    return _cycles(edges)


def test_no_import_circle_among_the_scripts():
    """Issue 62: no file-level circle anywhere in the tree — benchmarks/ and tools/ included
    (bench_peer_trl ↔ bench_step_profile and make_base ↔ tool_base were two)."""
    for folder in ("benchmarks", "tools"):
        assert not _script_cycles(ROOT / folder), folder
