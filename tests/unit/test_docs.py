"""The README and the guides in docs/ point at things that exist: every relative link resolves
to a file (and its #anchor to a heading of that file), every ``python -m MODULE`` in a fenced
command block names a module of the repository (or an installed one), and every
``bash tools/X.sh``, ``python tools/X.py`` and ``recipes/X.yaml`` in a command block exists.
A self-check on made-up documents shows each check fails on what it is meant to catch."""

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```", re.M | re.S)
MODULE = re.compile(r"python[0-9.]*\s+-m\s+([A-Za-z_][\w.]*)")
PATHS = re.compile(r"(?:bash\s+(tools/[\w./-]+\.sh)|python[0-9.]*\s+(tools/[\w./-]+\.py)|"
                   r"(recipes/[\w./-]+\.yaml))")  # fmt: skip
COMMAND_LANGS = {"", "bash", "sh", "shell", "console"}


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    h = re.sub(r"[`*_]", "", heading.strip().lower())
    h = re.sub(r"[^\w\- ]", "", h)
    return h.replace(" ", "-")


def _anchors(text: str) -> set:
    return {_slug(m) for m in re.findall(r"^#+\s+(.*)$", _without_code(text), re.M)}


def _without_code(text: str) -> str:
    return FENCE.sub("", text)


def broken_links(text: str, where: Path) -> list:
    """Relative links (and images) of ``text`` (a file in ``where``) that resolve to nothing."""
    bad = []
    body = _without_code(text)
    for target in LINK.findall(body) + IMAGE.findall(body):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("//"):
            continue  # http:, https:, mailto: — not checked here (no network)
        path, _, anchor = target.partition("#")
        f = (where / path).resolve() if path else None
        if f is not None and not f.exists():
            bad.append(target)
        elif anchor and (f is None or f.suffix == ".md"):
            doc = f.read_text() if f is not None else text
            if anchor not in _anchors(doc):
                bad.append(target)
    return bad


def command_blocks(text: str) -> list:
    """The fenced blocks a user runs (bash/sh/console or no language), joined continuations."""
    return [
        body.replace("\\\n", " ")
        for lang, body in FENCE.findall(text)
        if lang.strip() in COMMAND_LANGS
    ]


def _module_exists(name: str) -> bool:
    parts = name.split(".")
    local = ROOT.joinpath(*parts)
    if local.with_suffix(".py").is_file() or (local / "__init__.py").is_file():
        return True
    if (local / "__main__.py").is_file():
        return True
    if (ROOT / parts[0]).is_dir():  # one of ours, but no such file: never ask the installed copy
        return False
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def missing_commands(text: str) -> list:
    """``python -m`` modules and tools/recipes paths of the command blocks that do not exist."""
    bad = []
    for block in command_blocks(text):
        for line in block.splitlines():
            line = line.split("#", 1)[0]  # a comment may name what is not a command
            bad += [f"python -m {m}" for m in MODULE.findall(line) if not _module_exists(m)]
            for groups in PATHS.findall(line):
                bad += [p for p in groups if p and not (ROOT / p).is_file()]
    return bad


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(doc):
    assert broken_links(doc.read_text(), doc.parent) == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_commands_name_what_exists(doc):
    assert missing_commands(doc.read_text()) == []


def test_the_checks_catch_what_they_should(tmp_path):
    (tmp_path / "there.md").write_text("# A heading, with `code`\n")
    doc = (
        "[ok](there.md) [ok](there.md#a-heading-with-code) [web](https://example.com/x)\n"
        "[gone](missing.md) [bad anchor](there.md#nope) ![img](nope.png) [self](#top)\n"
        "# Top\n```python\npython -m not_a_module_anywhere\n```\n"
    )
    assert broken_links(doc, tmp_path) == ["missing.md", "there.md#nope", "nope.png"]
    cmds = (
        "```bash\npython -m megatron_p3o.train recipes/tiny_cpu.yaml   # recipes/gone.yaml\n"
        "python -m megatron_p3o.nope recipes/nope.yaml\nbash tools/quickstart.sh\n"
        "bash tools/nope.sh && python tools/nope.py\npython -m json.tool x\n```\n"
        "```python\npython -m not_checked_in_python_blocks\n```\n"
    )
    assert missing_commands(cmds) == [
        "python -m megatron_p3o.nope",
        "recipes/nope.yaml",
        "tools/nope.sh",
        "tools/nope.py",
    ]


def test_the_readme_is_short_and_has_the_users_path():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    blocks = "\n".join(command_blocks(text))
    for cmd in (
        "bash tools/quickstart.sh",
        "bash tools/run_tests.sh",
        "python -m checkpoints_convert.hf_to_megatron --hf HF_DIR --out CKPT",
        "python -m checkpoints_convert.megatron_to_hf --ckpt runs/tiny_cpu --out runs/tiny_cpu_hf",
        "python -m megatron_p3o.train recipes/tiny_cpu_sglang.yaml",
        "python -m megatron_p3o.stress",
    ):
        assert cmd in blocks, cmd
    # every guide in docs/ is reachable from the README
    linked = set(LINK.findall(text))
    for guide in sorted((ROOT / "docs").glob("*.md")):
        assert f"docs/{guide.name}" in linked, guide.name
