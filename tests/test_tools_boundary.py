"""The tools (``aioshmcache.tools``: demo, bench, stress) stand apart from the library.

The core never imports them, and they use the public API and, of the private modules, only the
documented internal API: the names the table "Internal API for the tools" of docs/design.md
lists, the one list of them. No other private core module or name, no reaching into a cache's
store or another object's private attributes.
"""

from __future__ import annotations

import ast
import importlib
import json
import pathlib
import pkgutil
import re
import subprocess
import sys

import aioshmcache

PKG = pathlib.Path(aioshmcache.__file__).resolve().parent
TOOLS = PKG / "tools"
DESIGN = PKG.parent / "docs" / "design.md"


def _internal_api(text: str) -> set[tuple[str, str]]:
    """(module, name) of every row of the design's table "Internal API for the tools"."""
    section = text.split("## Internal API for the tools", 1)[1].split("\n## ", 1)[0]
    found: set[tuple[str, str]] = set()
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and re.fullmatch(r"`aioshmcache\.[\w.]+`", cells[0]):
            found |= {(cells[0].strip("`"), n) for n in re.findall(r"`(\w+)`", cells[1])}
    return found


#: what the tools may take from private core modules, read from docs/design.md
INTERNAL_API = _internal_api(DESIGN.read_text())


def _core_modules() -> list[str]:
    """Every module of the package but the tools (and ``__main__``, which runs the CLI)."""
    return sorted(
        f"aioshmcache.{m.name}"
        for m in pkgutil.iter_modules([str(PKG)])
        if m.name not in ("tools", "__main__")
    )


def test_core_modules_found() -> None:
    mods = _core_modules()
    assert {"aioshmcache.cli", "aioshmcache.cache", "aioshmcache.aio"} <= set(mods)
    assert not any(m.startswith("aioshmcache.tools") for m in mods)


def test_the_core_never_imports_the_tools() -> None:
    """In a fresh interpreter: the package, every core module and the CLI's help load no tool."""
    code = (
        "import importlib, json, sys, contextlib, io\n"
        f"mods = {_core_modules()!r}\n"
        "import aioshmcache\n"
        "for m in mods:\n"
        "    importlib.import_module(m)\n"
        "from aioshmcache.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    main(['--help'])\n"
        "print(json.dumps(sorted(n for n in sys.modules if n.startswith('aioshmcache'))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(_core_modules()) <= set(loaded)
    assert [m for m in loaded if m.startswith("aioshmcache.tools")] == []


def _module_of(path: pathlib.Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(path: pathlib.Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = _module_of(path).split(".")
    if path.name != "__init__.py":
        package.pop()
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_private_core(module: str) -> bool:
    parts = module.split(".")
    if parts[0] != "aioshmcache" or module.startswith("aioshmcache.tools"):
        return False
    return any(p.startswith("_") for p in parts[1:])


def _private_uses(path: pathlib.Path, source: str | None = None) -> list[tuple[str, str]]:
    """(module, name) of every private core module or name the file imports or reaches."""
    found: list[tuple[str, str]] = []
    text = path.read_text() if source is None else source
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, "*") for a in node.names if _is_private_core(a.name)]
        elif isinstance(node, ast.ImportFrom):
            module = _resolve(path, node)
            if not module.startswith("aioshmcache") or module.startswith("aioshmcache.tools"):
                continue
            for a in node.names:
                if _is_private_core(module) or (a.name.startswith("_") and a.name != "__version__"):
                    found.append((module, a.name))
        elif isinstance(node, ast.Attribute):
            own = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            private = node.attr.startswith("_") and not node.attr.startswith("__")
            if not own and (private or node.attr == "store"):  # a cache's store is not public
                found.append((ast.unparse(node), node.attr))
    return found


def _forbidden(path: pathlib.Path, source: str | None = None) -> list[tuple[str, str]]:
    """The private uses of a tool that the internal API does not allow."""
    return [use for use in _private_uses(path, source) if use not in INTERNAL_API]


def test_the_internal_api_is_listed_and_documented() -> None:
    """The design's table names exported names of private modules, each function documented."""
    assert len(INTERNAL_API) >= 5
    for module, name in sorted(INTERNAL_API):
        mod = importlib.import_module(module)
        assert _is_private_core(module) and not name.startswith("_"), (module, name)
        assert hasattr(mod, name), f"docs/design.md lists {module}.{name}, which does not exist"
        assert name in getattr(mod, "__all__", ()), f"{module}.{name} is not in its __all__"
        obj = getattr(mod, name)
        if callable(obj):  # a function or class has a docstring; a constant the table's words
            assert (obj.__doc__ or "").strip(), f"{module}.{name} has no docstring"


def test_tools_use_only_the_public_and_the_internal_api() -> None:
    files = sorted(TOOLS.rglob("*.py"))
    assert len(files) > 20
    bad = {str(p.relative_to(PKG)): uses for p in files if (uses := _forbidden(p))}
    assert bad == {}
    used = {use for p in files for use in _private_uses(p)}
    assert used <= INTERNAL_API and used, "the tools' use of the internal API is seen"


def test_the_checker_sees_private_imports() -> None:
    """The AST check is not vacuous: it flags each kind of reaching in, and lets the listed
    internal API through."""
    probe = TOOLS / "stress" / "probe_for_test.py"  # never written: only its place matters
    src = (
        "from ... import _store\n"
        "from ..._segment import list_segments\n"
        "from aioshmcache._sweep import sweep\n"
        "from aioshmcache import _types\n"
        "import aioshmcache._ring\n"
        "from aioshmcache._inspect import read_snapshot, inspect_segment\n"
        "from ..._layout import SHM_DIR, H_HITS\n"
        "from aioshmcache._serde import MsgpackSerde\n"
        "def f(cache, x):\n"
        "    return cache.store.ring, x._secret\n"
    )
    uses = _forbidden(probe, src)
    assert ("aioshmcache", "_store") in uses
    assert ("aioshmcache._segment", "list_segments") in uses
    assert ("aioshmcache._sweep", "sweep") in uses
    assert ("aioshmcache", "_types") in uses
    assert ("aioshmcache._ring", "*") in uses
    assert ("aioshmcache._inspect", "inspect_segment") in uses
    assert ("aioshmcache._layout", "H_HITS") in uses
    assert ("aioshmcache._serde", "MsgpackSerde") in uses
    assert any(n == "store" for _m, n in uses) and any(n == "_secret" for _m, n in uses)
    assert ("aioshmcache._inspect", "read_snapshot") not in uses
    assert ("aioshmcache._layout", "SHM_DIR") not in uses
    assert not any(m.startswith("aioshmcache.tools") for m, _n in uses)


def test_the_table_is_read_as_written() -> None:
    """The design's table parser takes each row's names, and nothing from other sections."""
    text = (
        "## Internal API for the tools\n\n| module | names | what for |\n| --- | --- | --- |\n"
        "| `aioshmcache._a` | `x`, `Y` | why `not_a_name` |\n\n## Next\n"
        "| `aioshmcache._b` | `z` | later |\n"
    )
    assert _internal_api(text) == {("aioshmcache._a", "x"), ("aioshmcache._a", "Y")}


#: the one private door aio.py may use: the sync caches' request steps, private because they
#: return the private request objects (issue 23) and have exactly one driver, the async face
REQUEST_STEPS = frozenset(("_request", "_features_request", "_item_request"))


def test_the_async_facade_drives_requests_and_never_reaches_into_the_store() -> None:
    """aio.py touches no store and no private name of another module (issue: one algorithm)."""
    import ast
    import pathlib

    import aioshmcache.aio

    tree = ast.parse(pathlib.Path(aioshmcache.aio.__file__).read_text())
    imported = {
        a.asname or a.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for a in node.names
    }
    bad: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if node.attr == "store":
                bad.append(f"line {node.lineno}: .store")
            owner = node.value
            # another module's object: an imported name, or reached through an attribute
            # (self.sender._x); a local instance of the facade's own class is its own business
            foreign = isinstance(owner, ast.Attribute) or (
                isinstance(owner, ast.Name) and owner.id in imported
            )
            private = node.attr.startswith("_") and not node.attr.startswith("__")
            if foreign and private and node.attr not in REQUEST_STEPS:
                bad.append(f"line {node.lineno}: .{node.attr}")
        if isinstance(node, ast.ImportFrom):
            bad += [
                f"line {node.lineno}: import {a.name}"
                for a in node.names
                if a.name.startswith("_") and not a.name.startswith("__")
            ]
    assert bad == []
