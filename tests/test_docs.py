"""Documentation: every public class and method of the caches has a docstring; pydoc is clean."""

from __future__ import annotations

import dataclasses
import inspect
import pydoc
import re

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
