"""Documentation: docstrings, and docs that stand alone and stay true.

Every public class and method of the caches has a docstring and pydoc is clean; every link, and
every doc or test a page or a comment names (``docs/x.md``, ``tests/test_y.py::name``), exists;
the docs index lists every page; nothing points to files outside the repository; the README's
test command is CI's first step, and CI's second runs every marker the first leaves out; the
house of layers drawn in docs/design.md is the one the imports build.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import pydoc
import re
import tomllib
from pathlib import Path

import pytest

import aioshmcache.aio
import aioshmcache.cache

CLASSES = [
    aioshmcache.cache.SenderCache,
    aioshmcache.cache.ReceiverCache,
    aioshmcache.aio.AsyncSenderCache,
    aioshmcache.aio.AsyncReceiverCache,
    aioshmcache.aio.SingleFlightStats,
]


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_public_methods_have_docstrings(cls: type) -> None:
    assert inspect.getdoc(cls), cls
    missing = []
    for name, member in inspect.getmembers(cls):
        if name.startswith("_") and name not in ("__init__", "__enter__", "__aenter__"):
            continue
        if name == "__init__" and dataclasses.is_dataclass(cls):
            continue  # generated: the class docstring and the fields' comments say it
        func = member.fget if isinstance(member, property) else member
        if not (inspect.isfunction(func) or inspect.ismethod(func) or isinstance(member, property)):
            continue
        if getattr(func, "__module__", "").startswith("aioshmcache") and not func.__doc__:
            missing.append(name)
    assert not missing, f"{cls.__name__}: no docstring on {missing}"


@pytest.mark.parametrize("module", [aioshmcache.aio, aioshmcache.cache])
def test_pydoc_shows_no_source_comments(module: object) -> None:
    """A method without a docstring shows the comment above it; none may show up as docs."""
    text = pydoc.plain(pydoc.render_doc(module))
    assert not re.search(r"^\s*\|?\s*#", text, re.MULTILINE), "a source comment shows in pydoc"


ROOT = Path(__file__).resolve().parent.parent
#: the project's living pages (``bench/runs/`` is a record of past runs, kept as written)
PAGES = [
    "README.md",
    "examples/README.md",
    "tests/README.md",
    "bench/README.md",
    *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")),
]
#: the files whose comments and docstrings may name docs and tests (this one names made-up ones)
SOURCES = sorted(
    str(p.relative_to(ROOT))
    for d in ("aioshmcache", "tests", "examples", "bench")
    for p in (ROOT / d).rglob("*.py")
    if p != Path(__file__).resolve()
)


def _page(name: str) -> Path:
    return ROOT / name


@pytest.mark.parametrize("name", PAGES)
def test_every_relative_link_resolves(name: str) -> None:
    page = _page(name)
    broken = []
    for target in re.findall(r"\]\(([^)#\s]+)", page.read_text()):
        if "://" in target:
            continue
        resolved = (page.parent / target).resolve()
        if not resolved.exists():
            broken.append(target)
    assert not broken, f"{name}: links to missing files {broken}"


def test_readme_is_short_and_keeps_the_two_commands() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 120
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = next(ln for ln in ci.splitlines() if ln.startswith("python3 -m venv"))
    assert f"    {test_command}\n" in text  # the test command exactly as CI runs it
    assert "python -m aioshmcache demo" in text
    assert "## More than one host" in text and "docs/fleet.md" in text


def _extras(name: str, extras: dict[str, list[str]]) -> set[str]:
    """The requirements of extra ``name``, with the extras it names resolved."""
    out: set[str] = set()
    for req in extras[name]:
        if req.startswith("aioshmcache["):
            for inner in req[len("aioshmcache[") : -1].split(","):
                out |= _extras(inner, extras)
        else:
            out.add(req)
    return out


def test_the_readme_install_has_no_torch_and_ci_installs_it_for_the_torch_tests() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert not [r for r in _extras("test", extras) if r.startswith("torch")]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    first = next(i for i, ln in enumerate(ci) if ln.startswith("python3 -m venv"))
    assert "torch" not in ci[first]
    torch_install = next(i for i, ln in enumerate(ci) if "pip install" in ln and "torch" in ln)
    marked_run = next(i for i, ln in enumerate(ci) if "pytest -q -m" in ln)
    assert first < torch_install < marked_run


def test_ci_s_second_step_runs_every_marker_the_default_run_leaves_out() -> None:
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]
    addopts = options["ini_options"]["addopts"]
    left_out = set(re.findall(r"\bnot (\w+)", addopts[addopts.index("-m") + 1]))
    ci = (ROOT / ".ci" / "run").read_text()
    second = re.search(r'pytest -q -m "([^"]+)"', ci)
    assert second is not None
    selected = set(second.group(1).split(" or "))
    declared = {m.split(":")[0] for m in options["ini_options"]["markers"]}
    assert left_out == selected and selected <= declared
    assert "torch" in selected


#: a file named in prose: ``docs/x.md``, ``../bench/README.md``, ``tests/test_y.py::name``,
#: ``test_y.py::name`` (in tests/), ``tests/test_tier*.py``; ``::name`` alone continues the last
_REFERENCE = re.compile(
    r"(?<![\w./*-])((?:\.\./|[\w*-]+/)*[\w*-]+\.(?:md|py))(?![\w/])((?:::[\w]+\*?)?)"
    r"|(?<![\w:])::(\w+\*?)"
)
#: in code, only names with a folder of the repository count (``docs/x.md``, not ``x.py``)
_FOLDERS = ("docs/", "tests/", "examples/", "bench/", "aioshmcache/", "../")


def _counts(path: str, *, in_code: bool) -> bool:
    """Whether a name found in prose is checked: in a page, a bare ``x.py`` (or one under a
    folder this repository does not have) may be another project's file (vLLM's
    ``vllm/.../shm_object_storage.py``) or a module named in passing."""
    if in_code:
        return path.startswith(_FOLDERS)
    return path.startswith(_FOLDERS) or path.endswith(".md") or path.startswith("test_")


def _resolve(text: str, here: Path) -> list[Path]:
    """The files ``text`` (a path, maybe a glob) names, seen from the folder ``here``."""
    bases = [here, ROOT]
    if Path(text).name.startswith("test_") and "/" not in text:
        bases.append(ROOT / "tests")
    for base in bases:
        found = sorted(base.glob(text)) if "*" in text else [base / text]
        found = [f for f in found if f.exists()]
        if found:
            return found
    return []


def _defines(files: list[Path], name: str) -> bool:
    """Whether one of ``files`` defines ``name`` (a prefix, if it ends with ``*``)."""
    stem = re.escape(name.rstrip("*")) + (r"\w*" if name.endswith("*") else r"\b")
    pattern = re.compile(rf"^\s*(?:async\s+def|def|class)\s+{stem}|^{stem}\s*[:=]", re.MULTILINE)
    return any(pattern.search(f.read_text()) for f in files)


def _broken_references(text: str, here: Path, *, in_code: bool) -> list[str]:
    broken: list[str] = []
    files: list[Path] = []
    for match in _REFERENCE.finditer(text):
        path, name, continued = match.groups()
        if path is not None:
            if not _counts(path, in_code=in_code):
                files = []
                continue
            files = _resolve(path, here)
            if not files:
                broken.append(path)
                continue
            name = name[2:]
        else:
            name = continued
        if name and files and files[0].suffix == ".py" and not _defines(files, name):
            broken.append(f"{files[0].relative_to(ROOT)}::{name}")
    return broken


@pytest.mark.parametrize("name", PAGES)
def test_every_doc_and_test_named_in_a_page_exists(name: str) -> None:
    """A page that names ``docs/x.md`` or ``tests/test_y.py::test_z`` in prose names real ones."""
    page = _page(name)
    text = re.sub(r"https?://\S+", "", page.read_text())
    broken = _broken_references(text, page.parent, in_code=False)
    assert not broken, f"{name} names what does not exist: {broken}"


def test_every_doc_and_test_named_in_code_exists() -> None:
    broken = {
        name: found
        for name in SOURCES
        if (found := _broken_references((ROOT / name).read_text(), ROOT, in_code=True))
    }
    assert not broken, f"comments or docstrings name what does not exist: {broken}"


def test_the_reference_check_finds_what_is_missing() -> None:
    text = (
        "see docs/design.md, [x](../docs/nowhere.md), tests/test_docs.py::no_such_test, "
        "`test_docs.py::test_readme_is_short_and_keeps_the_two_commands`, `::_page`, "
        "`::nor_this`, tests/test_tier*.py, tests/test_nothing*.py, docs/x_y.md"
    )
    assert _broken_references(text, ROOT / "docs", in_code=False) == [
        "../docs/nowhere.md",
        "tests/test_docs.py::no_such_test",
        "tests/test_docs.py::nor_this",
        "tests/test_nothing*.py",
        "docs/x_y.md",
    ]
    assert _broken_references("a name.py, a docs/gone.md", ROOT, in_code=True) == ["docs/gone.md"]
    assert _broken_references("vLLM's shm_object_storage.py", ROOT, in_code=False) == []


def test_the_docs_index_lists_every_page_and_the_readme_points_to_it() -> None:
    index = (ROOT / "docs" / "README.md").read_text()
    listed = set(re.findall(r"\]\(([\w-]+\.md)\)", index))
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"}
    assert pages <= listed, f"docs/README.md does not list {sorted(pages - listed)}"
    readme = (ROOT / "README.md").read_text()
    assert "](docs/README.md)" in readme and "](docs/design.md)" in readme


#: names of files outside the repository, which its docs and code must never point to
_OUTSIDE = re.compile(
    "|".join(
        [
            r"\b(?:DESIGN|STYLE|NOTES)\.md\b",
            r"\bDESIGN\s*(?:§|section\s+\d|\d)",
            r"\bSTYLE:",
            r"\.\./shared\b",
        ]
    )
)


def test_no_file_points_outside_the_repository() -> None:
    hits = []
    for folder, dirs, files in os.walk(ROOT):
        # not .git, .venv or the tools' caches; .ci is the project's
        dirs[:] = [
            d for d in dirs if d == ".ci" or (not d.startswith((".", "__")) and ".egg" not in d)
        ]
        for file in files:
            path = Path(folder, file)
            if path.suffix in (".py", ".md", ".toml", ".txt", ""):
                text = path.read_text(errors="replace")
                rel = path.relative_to(ROOT)
                hits += [f"{rel}: {m.group(0)}" for m in _OUTSIDE.finditer(text)]
    assert not hits, f"mentions of files outside the repository: {hits}"
    assert _OUTSIDE.search("see " + "DESIGN" + " §5") and _OUTSIDE.search("NOTES" + ".md")


PACKAGE = ROOT / "aioshmcache"


def _modules() -> set[str]:
    """The package's modules and subpackages, but the tools (the roof) and ``__main__``."""
    found = {p.stem for p in PACKAGE.glob("*.py")} | {
        p.parent.name for p in PACKAGE.glob("*/__init__.py")
    }
    return found - {"__init__", "__main__", "tools"}


def _floors() -> dict[str, int]:
    """Each module of the package and its floor, read from the drawing in docs/design.md."""
    text = (ROOT / "docs" / "design.md").read_text()
    drawing = text.split("## Layers", 1)[1].split("```", 2)[1]
    modules = _modules()
    floors: dict[str, int] = {}
    floor = 0
    for line in drawing.splitlines():
        head = re.match(r"\s*(\d+)\s", line)
        if head:
            floor = int(head.group(1))
        elif re.match(r"\s*roof\b", line):
            floor = 0
        for word in re.findall(r"[\w.]+", line):
            if floor and word in modules:
                assert word not in floors, f"docs/design.md draws {word} on two floors"
                floors[word] = floor
    return floors


def _imported(module: str) -> set[str]:
    """The package's modules that ``module`` (a file or a subpackage) imports, at any depth."""
    files = [PACKAGE / f"{module}.py"] if (PACKAGE / f"{module}.py").exists() else []
    files += sorted((PACKAGE / module).rglob("*.py"))
    found: set[str] = set()
    for file in files:
        package = ("aioshmcache", *file.relative_to(PACKAGE).parent.parts)
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else ()
                name = ".".join((*base, node.module or ""))
                names = [name] if node.module else [f"{name}{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[0] == "aioshmcache" and len(parts) > 1 and parts[1] != module:
                    found.add(parts[1])
    return found


def test_the_house_in_the_design_is_the_code_s() -> None:
    """Every module is on one floor of docs/design.md, and none imports from a floor above it."""
    floors = _floors()
    missing = sorted(_modules() - floors.keys())
    assert not missing, f"not drawn in docs/design.md: {missing}"
    upward = [
        f"{module} (floor {floor}) imports {other} (floor {floors[other]})"
        for module, floor in floors.items()
        for other in sorted(_imported(module))
        if floors.get(other, 0) > floor
    ]
    assert not upward, f"imports that run back up the house of docs/design.md: {upward}"
    assert _imported("wire") >= {"_types", "_serde", "errors"}  # the walk sees what is there
