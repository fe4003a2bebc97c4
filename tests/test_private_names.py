"""No module of xopt uses another package's private names.

A name that starts with ``_`` (a module ``_lowrank``, a function ``_as_array``) belongs to
the package that defines it and to the packages inside it: ``xopt.specs.lowrank`` may be
used by ``xopt.specs.galore``, not by ``xopt.torch.galore``; ``xopt._atomic`` by every
subpackage of ``xopt``. What one package needs from another is public in its module.

The check parses every module under ``xopt/`` (no import, so no framework is needed): each
``import``/``from ... import`` of an xopt path, and each attribute read on a name bound to
an xopt module (``_spec._k`` where ``_spec`` is ``xopt.specs.small_fc_lopt``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from helpers import REPO

ROOT = REPO / "xopt"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_package(dotted: str) -> bool:
    return (REPO.joinpath(*dotted.split(".")) / "__init__.py").is_file()


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def owner_of(dotted: str) -> str | None:
    """The package a path's first private name belongs to (None: the path is public).

    ``xopt.specs._lowrank.svd`` -> ``xopt.specs``; ``xopt.specs.velo._as_array`` ->
    ``xopt.specs`` (the package of the module that defines it); ``xopt._atomic`` -> ``xopt``.
    """
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        if _private(part):
            parent = ".".join(parts[:i])
            return parent if _is_package(parent) else ".".join(parts[:i - 1])
    return None


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _resolve(node: ast.ImportFrom, module: str, path: Path) -> str:
    if not node.level:
        return node.module or ""
    base = _package_of(module, path).split(".")
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def uses(path: Path) -> list[tuple[int, str]]:
    """``(line, dotted xopt path)`` of every import and every attribute read on an imported
    xopt module or object in ``path``."""
    module = _module_name(path)
    tree = ast.parse(path.read_text(), filename=str(path))
    bound: dict[str, str] = {}
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "xopt":
                    out.append((node.lineno, a.name))
                    if a.asname:
                        bound[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom):
            src = _resolve(node, module, path)
            if src.split(".")[0] != "xopt":
                continue
            for a in node.names:
                full = f"{src}.{a.name}"
                out.append((node.lineno, full))
                bound[a.asname or a.name] = full
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in bound):
            out.append((node.lineno, f"{bound[node.value.id]}.{node.attr}"))
    return out


MODULES = sorted(ROOT.rglob("*.py"))


def test_the_rule_itself():
    assert owner_of("xopt.specs._lowrank.svd") == "xopt.specs"
    assert owner_of("xopt.specs.velo._as_array") == "xopt.specs"
    assert owner_of("xopt._atomic.atomic_path") == "xopt"
    assert owner_of("xopt.specs.galore.GaLore.__init__") is None
    assert owner_of("xopt.specs.lowrank.refresh") is None


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(REPO)))
def test_no_module_uses_another_packages_private_names(path):
    module = _module_name(path)
    package = _package_of(module, path)
    bad = []
    for line, dotted in uses(path):
        owner = owner_of(dotted)
        if owner is not None and not (package == owner or package.startswith(owner + ".")):
            bad.append(f"{path.relative_to(REPO)}:{line}: {dotted} (private to {owner})")
    assert not bad, "\n".join(bad)
