"""The core's two implementations: selection at import, layout constants, the build.

``aioshmcache._core`` (C, built by ``hatch_build.py``) and ``aioshmcache._core_py`` (the
pure-Python reference) expose the same names; ``_core_api`` picks one (``AIOSHM_PURE=1``
forces the reference). The differential tests (``test_differential_core.py``) compare their
results; here: what picks one, and that a machine without a compiler still installs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

import aioshmcache
from aioshmcache import _core_api, _core_py, _layout, _types

ROOT = Path(__file__).resolve().parent.parent
PIP = [sys.executable, "-m", "pip"]


def c_core() -> ModuleType | None:
    """The compiled core, or None when it was not built here."""
    try:
        from aioshmcache import _core
    except ImportError:
        return None
    return _core


needs_c = pytest.mark.skipif(c_core() is None, reason="the C core is not built here")


def _implementation_with(env: dict[str, str]) -> str:
    out = subprocess.run(
        [sys.executable, "-c", "import aioshmcache; print(aioshmcache.implementation())"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return out.stdout.strip()


def test_implementation_is_exported_and_names_the_core_in_use() -> None:
    assert "implementation" in aioshmcache.__all__
    impl = aioshmcache.implementation()
    assert impl in ("c", "python")
    if _core_api.pure_forced() or c_core() is None:
        assert impl == "python" and _core_api.core is _core_py
    else:
        assert impl == "c" and _core_api.core is c_core()


def test_aioshm_pure_forces_the_python_core() -> None:
    assert _implementation_with({"AIOSHM_PURE": "1"}) == "python"
    expected = "c" if c_core() is not None else "python"
    assert _implementation_with({"AIOSHM_PURE": "0"}) == expected
    assert _implementation_with({"AIOSHM_PURE": ""}) == expected


@needs_c
def test_c_layout_constants_equal_the_python_layout() -> None:
    c = c_core()
    assert c is not None
    assert c.LAYOUT == _core_py.LAYOUT
    # and the reference's table is _layout's own values (no copy typed by hand)
    for name, value in _core_py.LAYOUT.items():
        if hasattr(_layout, name):
            assert getattr(_layout, name) == value, name
    # the tag's address multiplier: the tag of address 1, every other field 0, is that constant
    assert _core_py.LAYOUT["TAG_M2"] == _types.tag_base(0, 0, 1, 0, 0, 0)


def test_the_c_module_is_the_one_typed_by_its_stub() -> None:
    stub = (ROOT / "aioshmcache" / "_core.pyi").read_text()
    for name in _core_py.__all__:
        assert f"{name}" in stub, name
    c = c_core()
    if c is not None:
        assert set(_core_py.__all__) <= set(dir(c))


def _build_wheel(tmp_path: Path, env: dict[str, str]) -> tuple[Path, str]:
    out = tmp_path / "wheel"
    proc = subprocess.run(
        [*PIP, "wheel", "-v", "--no-deps", "--no-build-isolation", str(ROOT), "-w", str(out)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    (wheel,) = out.glob("*.whl")
    return wheel, proc.stdout + proc.stderr


def _install_and_ask(tmp_path: Path, wheel: Path, package_at: Path | None = None) -> str:
    """Install ``wheel`` into a directory of its own (``--target``: an install into a prefix
    would uninstall this environment's own aioshmcache) and ask, in a new interpreter that sees
    it and not this checkout, which core runs; its package must be at ``package_at`` (default:
    that directory; an editable install's sources for an editable wheel)."""
    target = tmp_path / "site"
    subprocess.run(
        [*PIP, "install", "-q", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
        capture_output=True,
        timeout=600,
        check=True,
    )
    code = (  # this checkout (this environment's own editable install) out of the way first
        "import site, sys; sys.path[:] = [p for p in sys.path if p != sys.argv[3]]; "
        "site.addsitedir(sys.argv[1]); import aioshmcache; "
        "assert aioshmcache.__file__.startswith(sys.argv[2]), aioshmcache.__file__; "
        "print(aioshmcache.implementation())"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("AIOSHM_PURE", "PYTHONPATH")}
    at = package_at or target
    got = subprocess.run(
        [sys.executable, "-c", code, str(target), str(at), str(ROOT)],
        env=env,
        cwd=tmp_path,  # not the checkout: ``-c`` puts the working directory first on the path
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return got.stdout.strip()


@pytest.mark.slow
def test_a_machine_without_a_compiler_installs_the_pure_package(tmp_path: Path) -> None:
    wheel, log = _build_wheel(tmp_path, {"CC": "/bin/false"})
    assert "the C core was not built" in log  # the one line that says so
    assert wheel.name.endswith("-py3-none-any.whl")
    with zipfile.ZipFile(wheel) as z:
        assert not [n for n in z.namelist() if n.endswith(".so")]
    assert _install_and_ask(tmp_path, wheel) == "python"


@pytest.mark.slow
def test_an_editable_install_without_a_compiler_is_pure_and_drops_a_stale_core(
    tmp_path: Path,
) -> None:
    """``pip install -e .`` where the compile fails: the one line, no core left in place (one
    built before is removed: it must not outlive the failed build), and the installed package
    runs the pure core. The editable wheel is built as pip builds it (the backend's
    ``build_editable``, no isolation)."""
    src = tmp_path / "src"
    shutil.copytree(
        ROOT,
        src,
        ignore=shutil.ignore_patterns(".*", "tests", "bench", "examples", "docs", "__pycache__"),
    )
    stale = src / "aioshmcache" / ("_core" + sysconfig.get_config_var("EXT_SUFFIX"))
    stale.write_bytes(b"a core built before")  # whatever was in place: it must go
    out = tmp_path / "wheel"
    build = "import sys; from hatchling.build import build_editable; build_editable(sys.argv[1])"
    proc = subprocess.run(
        [sys.executable, "-c", build, str(out)],
        cwd=src,
        env={**os.environ, "CC": "/bin/false"},
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    assert "the C core was not built" in proc.stdout + proc.stderr
    assert not list((src / "aioshmcache").glob("_core*.so"))
    (wheel,) = out.glob("*.whl")
    assert _install_and_ask(tmp_path, wheel, package_at=src) == "python"


@pytest.mark.slow
def test_a_wheel_built_with_a_compiler_carries_the_c_core(tmp_path: Path) -> None:
    if c_core() is None:
        pytest.skip("no working compiler here: the pure case is the test above")
    wheel, _ = _build_wheel(tmp_path, {})
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    with zipfile.ZipFile(wheel) as z:
        assert f"aioshmcache/_core{suffix}" in z.namelist()
    assert "-py3-none-any" not in wheel.name
    assert _install_and_ask(tmp_path, wheel) == "c"
