"""The documentation site builds with no warnings, and its API reference covers every
public name of the package.

The site is built once per module (``mkdocs build --strict`` into a temporary directory,
exactly as a maintainer builds it); the API reference's coverage is read from the
inventory the build writes (``objects.inv``: one line per documented object) and checked
against the package itself, imported module by module, so that the list of public names
does not come from the tool that renders them.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import pkgutil
import subprocess
import sys
import zlib

import pytest
from helpers import REPO

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings")
    is None, reason="the docs tools (mkdocs, mkdocs-material, mkdocstrings) are not installed: "
                    "pip install --group dev")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f",
                           str(REPO / "mkdocs.yml"), "-d", str(out)],
                          capture_output=True, text=True, cwd=REPO, env=env)
    return proc, out


def test_docs_build_strict(site):
    proc, out = site
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert (out / "index.html").is_file()
    for page in ("getting-started", "methods/adamw", "methods/velo", "methods/poet",
                 "parity", "porter", "benchmarks", "kernels", "api/torch"):
        assert (out / page / "index.html").is_file(), page


def _inventory(out) -> set[str]:
    """The object names of a Sphinx-format inventory (version 2: four header lines, then
    zlib-compressed lines ``name domain:role priority uri dispname``)."""
    data = (out / "objects.inv").read_bytes()
    header = data.split(b"\n", 4)
    assert header[0] == b"# Sphinx inventory version 2"
    return {line.split(" ", 1)[0] for line in zlib.decompress(header[4]).decode().splitlines()}


def _public_modules() -> list[str]:
    import xopt

    names = ["xopt"]
    for info in pkgutil.walk_packages(xopt.__path__, "xopt."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            names.append(info.name)
    return names


def _public_names(module) -> list[str]:
    """``__all__`` where the module has one, else the classes and functions it defines
    (not those it imports) whose names do not start with ``_``."""
    if hasattr(module, "__all__"):
        return [n for n in module.__all__ if not n.startswith("_")]
    return [n for n, v in vars(module).items() if not n.startswith("_")
            and (inspect.isclass(v) or inspect.isfunction(v))
            and getattr(v, "__module__", None) == module.__name__]


def test_api_reference_covers_every_public_name(site):
    proc, out = site
    assert proc.returncode == 0, proc.stderr[-3000:]
    documented = _inventory(out)
    missing, checked = [], 0
    for modname in _public_modules():
        module = importlib.import_module(modname)
        if modname not in documented:
            missing.append(f"module {modname}")
        for name in _public_names(module):
            obj = getattr(module, name)
            where = {f"{modname}.{name}"}
            if inspect.ismodule(obj):
                where.add(obj.__name__)
            elif hasattr(obj, "__module__") and hasattr(obj, "__qualname__"):
                where.add(f"{obj.__module__}.{obj.__qualname__}")  # a re-export
            checked += 1
            if not where & documented:
                missing.append(f"{modname}.{name}")
    assert checked > 200  # the package's public surface, not an empty walk
    assert not missing, ("public names missing from the API reference (docs/_ext/"
                         "api_pages.py lists the pages):\n" + "\n".join(missing))
