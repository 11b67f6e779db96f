"""Documentation: every public class and method of the caches has a docstring; pydoc is clean."""

from __future__ import annotations

import dataclasses
import inspect
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
PAGES = ["README.md", "examples/README.md", *sorted(p.name for p in (ROOT / "docs").glob("*.md"))]


def _page(name: str) -> Path:
    return ROOT / name if "/" in name or name == "README.md" else ROOT / "docs" / name


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
