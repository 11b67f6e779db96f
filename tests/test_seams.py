"""Each part owns its state: no object reaches into another object's private attributes.

``tests/test_docs.py::test_private_names_stay_in_their_module_or_subpackage`` holds a module's
private *names* to it; this file holds an object's private *attributes* to it: in the package,
``x._name`` is read or written only where ``x`` is ``self`` or ``cls``, an object the same
function has just made of its own class (``cls.__new__(cls)``, ``cls(...)``), or a class of the
same module naming its own private; every other such access is listed below with its reason.
The owning object offers what others need as a small documented method or property instead.

The tests are held to the same rule, with one more exception: white-box tests may reach the
private attributes the table "Internal API for tests" of docs/design.md lists (the one list of
them, with why); a test file not moved yet could be exempted in ``NOT_YET_MOVED`` (none is).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "aioshmcache"
TESTS = ROOT / "tests"

#: the reaches the package still makes, ``"module path: object.attribute"``, each with its reason
ALLOWED_REACHES: dict[str, str] = {
    # documented names that merely start with an underscore
    "_channel_keeper.py: os._exit": "the standard library's exit without cleanup (after fork)",
    "wire.py: ShmRef._fields": "a named tuple's documented field list",
    # the compiled core's contract (docs/core.md): the C extension looks these names up by
    # string, and its pure-Python reference reads them as the C code does
    "_core_read_py.py: slot._ack_lock": "the core's contract: the reader slot's log lock",
    "_core_read_py.py: slot._overflow": "the core's contract: the reader slot's overflow list",
    # inside one subpackage: the serde's plan is the serde's own type (``_serde.encode``), whose
    # fields the compiled core also reads by name (``_layout``, ``_sources``)
    "_serde/__init__.py: plan._layout": "inside the serde subpackage (and the core's contract)",
    "_serde/__init__.py: plan._sources": "inside the serde subpackage (and the core's contract)",
    "_serde/encode.py: plan._layout": "inside the serde subpackage (and the core's contract)",
    "_serde/encode.py: plan._sources": "inside the serde subpackage (and the core's contract)",
    # a sync cache's request constructors stay private so that the public faces stay twins
    # (tests/test_twins.py): the async twin and the lease drive the wrapped cache's steps
    "aio.py: self._wrapped()._request": "the async twin drives the wrapped sync sender",
    "aio.py: self._wrapped()._features_request": "the async twin drives the wrapped sync sender",
    "aio.py: cache._put_one": "the async twin drives the wrapped sync sender",
    "aio.py: self.receiver._item_request": "the async twin drives the wrapped sync receiver",
    "aio.py: receiver._request": "the async twin drives the wrapped sync receiver",
    "aio.py: receiver._read_one_feature": "the async twin takes the wrapped receiver's read",
    "cache.py: self._cache._request": "a lease drives its receiver's request (same module)",
    # the sender request's hot path inlines its book's counting (``SenderBook.count_hit`` /
    # ``count_miss``, same module): one attribute look-up less per feature
    "_request.py: book._words": "inlined SenderBook counting on the hit/miss hot path",
    # the sync face's one-item shortcut is ``run_one``'s first step without its frame: it calls
    # the request module's core entry by its module attribute (tests swap in the pure core's)
    "cache.py: _request._put_item": "the sync face's one-item shortcut (run_one's first step)",
}


def _made_here(func: ast.AST) -> set[str]:
    """Names a function binds to an object of its own class (``cls.__new__(cls)``, ``cls()``,
    ``_new_object(cls)``): that object is the function's own, as ``self`` is."""
    own: set[str] = set()
    for node in ast.walk(func):
        if not isinstance(node, ast.Assign) or not isinstance(node.value, ast.Call):
            continue
        call = node.value
        callee = ast.unparse(call.func)
        by_cls = callee in ("cls", "cls.__new__") or any(
            isinstance(a, ast.Name) and a.id == "cls" for a in call.args
        )
        if by_cls:
            own.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return own


def private_reaches(sources: dict[Path, str] | None = None) -> set[str]:
    """``"module path: object.attribute"`` for each private attribute reached on another object
    (``sources``: path in the package -> text; default: the package)."""
    if sources is None:
        sources = {f.relative_to(PACKAGE): f.read_text() for f in sorted(PACKAGE.rglob("*.py"))}
    found: set[str] = set()
    for rel, text in sources.items():
        tree = ast.parse(text)
        classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
        own_by_line: dict[int, set[str]] = {}
        for func in ast.walk(tree):
            if isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
                made = _made_here(func)
                for line in range(func.lineno, (func.end_lineno or func.lineno) + 1):
                    own_by_line.setdefault(line, set()).update(made)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            name = node.attr
            if not name.startswith("_") or name.startswith("__"):
                continue
            value = node.value
            if isinstance(value, ast.Name):
                if value.id in ("self", "cls") or value.id in classes:
                    continue
                if value.id in own_by_line.get(node.lineno, ()):
                    continue
            found.add(f"{rel}: {ast.unparse(value)}.{name}")
    return found


def test_no_object_reaches_into_another_s_private_attributes() -> None:
    """Every ``x._name`` in the package is on ``self``/``cls``/its own new object, or listed."""
    found = private_reaches()
    assert sorted(found - ALLOWED_REACHES.keys()) == []
    assert sorted(ALLOWED_REACHES.keys() - found) == [], "a listed reach is gone: drop it"


def test_the_reach_check_sees_a_reach() -> None:
    """The checker itself: reaches on other objects are seen, an object's own are not."""
    probe = {
        Path("a.py"): (
            "class A:\n"
            "    _K = 1\n"
            "    def f(self, b):\n"
            "        self._x = b._y\n"
            "        return self.store._seg, A._K, cls._z\n"
            "    @classmethod\n"
            "    def make(cls, other):\n"
            "        new = cls.__new__(cls)\n"
            "        new._x = other._w\n"
            "        return new\n"
            "def g(obj):\n"
            "    return obj._q, os.getpid()\n"
        ),
    }
    assert private_reaches(probe) == {
        "a.py: b._y",
        "a.py: self.store._seg",
        "a.py: other._w",
        "a.py: obj._q",
    }


#: names that merely start with an underscore: documented API of the standard library and of
#: named tuples, not private attributes
PUBLIC_UNDERSCORE = frozenset({"_asdict", "_exit", "_fields", "_replace"})

#: test files whose reaches are not moved to the documented internal API yet, with why (none:
#: every test file reaches only the table's attributes)
NOT_YET_MOVED: dict[str, str] = {}


def internal_api_for_tests(text: str | None = None) -> dict[str, str]:
    """Each attribute of the table "Internal API for tests" in docs/design.md, with its row."""
    if text is None:
        text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("## Internal API for tests", 1)[1].split("\n## ", 1)[0]
    found: dict[str, str] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`_"):
            for name in re.findall(r"`(_\w+)`", cells[0]):
                assert name not in found, f"{name} is listed twice"
                found[name] = line
    return found


def reaches_of_tests(sources: dict[Path, str] | None = None) -> set[str]:
    """The private reaches of the test files (``sources``: path in tests -> text; default: the
    tests), but the public names that merely start with an underscore."""
    if sources is None:
        sources = {f.relative_to(TESTS): f.read_text() for f in sorted(TESTS.glob("*.py"))}
    return {r for r in private_reaches(sources) if r.rsplit(".", 1)[1] not in PUBLIC_UNDERSCORE}


def test_tests_reach_only_the_documented_internal_api() -> None:
    """Every reach of a test into a private attribute is in the design's table, or in a file
    not moved yet; every row of the table, and every file not moved yet, is still needed."""
    api = internal_api_for_tests()
    reaches = reaches_of_tests()
    moved = {r for r in reaches if r.split(":", 1)[0] not in NOT_YET_MOVED}
    assert sorted(r for r in moved if r.rsplit(".", 1)[1] not in api) == []
    used = {r.rsplit(".", 1)[1] for r in moved}
    assert sorted(api.keys() - used) == [], "a listed attribute no test reaches: drop its row"
    files = {r.split(":", 1)[0] for r in reaches}
    assert sorted(NOT_YET_MOVED.keys() - files) == [], "a file not moved yet reaches nothing now"


def test_the_test_reach_check_reads_the_table_and_sees_a_reach() -> None:
    """The checker itself: the table's rows are read, and a test's reaches are found."""
    table = (
        "## Internal API for tests\n\n| attributes | of | why |\n| --- | --- | --- |\n"
        "| `_a`, `_b` | `X` | why |\n\n## Next\n| `_c` | `Y` | not this section |\n"
    )
    assert internal_api_for_tests(table).keys() == {"_a", "_b"}
    probe = {Path("test_x.py"): "def test_x(w, ref):\n    return w._ledger, ref._replace(a=1)\n"}
    assert reaches_of_tests(probe) == {"test_x.py: w._ledger"}
