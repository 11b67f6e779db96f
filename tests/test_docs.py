"""Documentation: docstrings, and docs that stand alone and stay true.

Every public class and method of the caches has a docstring and pydoc is clean; every link, and
every doc or test a page or a comment names (``docs/x.md``, ``tests/test_y.py::name``), exists;
the docs index lists every page; nothing points to files outside the repository; the README's
test command is CI's first step, and CI's second runs every marker the first leaves out; the
house of layers drawn in docs/design.md is the one the imports build (no upward import, no
import cycle), and a module's private names stay in it (or in its subpackage).
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


def _type_checking_only(node: ast.AST) -> bool:
    """``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``): a block only the type checker reads."""
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported(module: str) -> set[str]:
    """The package's modules that ``module`` (a file or a subpackage) imports, at any depth."""
    files = [PACKAGE / f"{module}.py"] if (PACKAGE / f"{module}.py").exists() else []
    files += sorted((PACKAGE / module).rglob("*.py"))
    found: set[str] = set()
    for file in files:
        package = ("aioshmcache", *file.relative_to(PACKAGE).parent.parts)
        tree = ast.parse(file.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and _type_checking_only(node):
                node.body = []  # the checker's imports never run: no import cycle at run time
        for node in ast.walk(tree):
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
    upward = _upward(_graph(), floors)
    assert not upward, f"imports that run back up the house of docs/design.md: {upward}"
    assert _imported("wire") >= {"_types", "_serde", "errors"}  # the walk sees what is there


def _graph() -> dict[str, set[str]]:
    """The package's import graph: each module (a file or a subpackage) and those it imports."""
    modules = _modules()
    return {m: _imported(m) & modules for m in modules}


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Every import cycle of ``graph``: its strongly connected parts of more than one module
    (and any module that imports itself), found by Tarjan's algorithm."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = {stack.pop()}
            while v not in part:
                part.add(stack.pop())
            if len(part) > 1 or v in graph[v]:
                found.append(part)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _upward(graph: dict[str, set[str]], floors: dict[str, int]) -> list[str]:
    """Every import from a module to one on a higher floor of the house."""
    return [
        f"{module} (floor {floor}) imports {other} (floor {floors[other]})"
        for module, floor in floors.items()
        for other in sorted(graph.get(module, ()))
        if floors.get(other, 0) > floor
    ]


#: import cycles the code has today; none is left, and the list only shrinks
KNOWN_CYCLES: list[set[str]] = []


def test_the_house_has_no_import_cycle() -> None:
    """No two modules import each other, directly or around a loop (lazy imports count)."""
    cycles = _cycles(_graph())
    assert [c for c in cycles if c not in KNOWN_CYCLES] == []


def test_the_house_checks_find_cycles_and_upward_imports() -> None:
    """The graph checks are not vacuous: a loop, a self-import and an upward import are seen."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "d"}, "e": set()}
    assert sorted(map(sorted, _cycles(graph))) == [["a", "b", "c"], ["d"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    upward = _upward({"x": {"y"}, "y": set()}, {"x": 1, "y": 2})
    assert upward == ["x (floor 1) imports y (floor 2)"]
    assert _upward({"x": {"y"}, "y": set()}, {"x": 2, "y": 2}) == []
    assert {"_serde", "_inspect", "_segment"} <= _graph()["metrics"] | _graph()["_store"]


#: modules whose private names other modules still import (issue 30 part 1: to shrink); the
#: names of every other module are its own, but inside a subpackage
PRIVATE_NAMES_SHARED = frozenset({"_types", "_request", "wire"})


def _private_imports(
    sources: dict[Path, str] | None = None, shared: frozenset[str] = PRIVATE_NAMES_SHARED
) -> list[str]:
    """``importer: module.name`` for each private name imported from another module (but from
    the ``shared`` modules); ``sources``: path in the package -> text (default: the package)."""
    if sources is None:
        sources = {f.relative_to(PACKAGE): f.read_text() for f in sorted(PACKAGE.rglob("*.py"))}
    found: list[str] = []
    for rel, text in sources.items():
        if rel.parts[0] == "tools":
            continue  # the roof: tests/test_tools_boundary.py holds the tools to their rule
        package = ("aioshmcache", *rel.parent.parts)
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.ImportFrom) or not node.module:
                continue
            base = package[: len(package) - node.level + 1] if node.level else ()
            parts = [*base, *node.module.split(".")]
            if parts[0] != "aioshmcache" or len(parts) < 2:
                continue
            inside = len(rel.parts) > 1 and parts[1] == rel.parts[0]  # within one subpackage
            for alias in node.names:
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                if private and not inside and parts[1] not in shared:
                    found.append(f"{rel}: {'.'.join(parts[1:])}.{alias.name}")
    return found


def test_private_names_stay_in_their_module_or_subpackage() -> None:
    """No module imports another's private name (``from ._x import _y``), but inside one
    subpackage: the serde's modules share theirs, the rest of the package imports its public
    names (``MsgpackSerde``, ``MsgpackPlan``, ``unpack_bounded``, ...)."""
    assert _private_imports() == []
    # not vacuous: a private name taken across modules is seen, a subpackage's own sharing and
    # a module's private name that is not taken are not
    probe = {
        Path("a.py"): "from ._serde.decode import _Compiler\nfrom .b import _x, y\n",
        Path("_serde/encode.py"): "from .format import _MAGIC\nfrom ..errors import E\n",
        Path("_serde/__init__.py"): "from .decode import _C\nfrom aioshmcache._b import _z\n",
        Path("tools/t.py"): "from aioshmcache._b import _z\n",
    }
    assert _private_imports(probe, frozenset({"b"})) == [
        "a.py: _serde.decode._Compiler",
        "_serde/__init__.py: _b._z",
    ]
