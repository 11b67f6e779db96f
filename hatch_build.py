"""Build hook: compile the C core (``aioshmcache/_core*.c`` -> ``aioshmcache._core``).

Runs for ``pip install -e .`` (the extension is built in place, next to the sources) and for
``pip wheel .`` (built in a temporary directory and put into the wheel, which is then tagged
for this interpreter and platform). Any failure (no compiler, no Python headers, a compile
error) prints one line and installs the pure-Python package instead: the package then runs its
pure-Python core (``aioshmcache.implementation() == "python"``).

Environment: ``CC`` picks the compiler (default: the one Python was built with);
``AIOSHM_CFLAGS`` adds flags (CI builds with ``-fsanitize=address,undefined`` this way);
``AIOSHM_PURE_BUILD=1`` skips the compile (a pure package on purpose).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

PACKAGE = "aioshmcache"
MODULE = "_core"
#: the flags every build uses (``AIOSHM_CFLAGS`` come after, so they may override these)
BASE_FLAGS = ["-O2", "-std=gnu11", "-fPIC", "-shared", "-Wall", "-fvisibility=hidden"]


def sources(root: Path) -> list[Path]:
    """The C files of the module: ``_core.c`` (the module definition) and every other section
    ``_core_*.c``, in a fixed order."""
    pkg = root / PACKAGE
    return [pkg / f"{MODULE}.c", *sorted(pkg.glob(f"{MODULE}_*.c"))]


def compile_core(root: Path, out: Path) -> str | None:
    """Compile the module to ``out``; the reason it failed, or None."""
    cc = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    include = sysconfig.get_paths()["include"]
    extra = shlex.split(os.environ.get("AIOSHM_CFLAGS", ""))
    srcs = [str(s) for s in sources(root)]
    cmd = [*cc, *BASE_FLAGS, f"-I{include}", f"-I{root / PACKAGE}", *extra, *srcs, "-o", str(out)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{cc[0]}: {exc}"
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout or "").strip().splitlines()
        return f"{cc[0]} exited with {proc.returncode}" + (f": {lines[0]}" if lines else "")
    return None


class CustomBuildHook(BuildHookInterface):  # type: ignore[type-arg]
    """Compile the core; on failure, build the pure package and say so in one line."""

    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel":
            return  # an sdist ships the sources
        root = Path(self.root)
        name = MODULE + sysconfig.get_config_var("EXT_SUFFIX")
        in_place = root / PACKAGE / name
        if version == "editable":
            in_place.unlink(missing_ok=True)  # a stale build must not outlive a failed one
            out = in_place
        else:
            self._tmp = tempfile.TemporaryDirectory(prefix="aioshm-build-")
            out = Path(self._tmp.name) / name
        if os.environ.get("AIOSHM_PURE_BUILD", "") not in ("", "0"):
            why: str | None = "AIOSHM_PURE_BUILD is set"
        else:
            why = compile_core(root, out)
        if why is not None:
            print(
                f"aioshmcache: the C core was not built ({why}); installing the pure-Python "
                "core (aioshmcache.implementation() == 'python')",
                file=sys.stderr,
                flush=True,
            )
            return
        build_data["pure_python"] = False
        build_data["infer_tag"] = True
        if version != "editable":
            build_data["force_include"][str(out)] = f"{PACKAGE}/{name}"

    def finalize(self, version: str, build_data: dict[str, Any], artifact_path: str) -> None:
        tmp = getattr(self, "_tmp", None)
        if tmp is not None:
            tmp.cleanup()
