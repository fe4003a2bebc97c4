"""MkDocs hook: the API reference pages, generated from the package tree at build time.

One page per area of the package (``api/<area>.md``), one ``:::`` section per public
module found under it, so a module added or removed is documented or dropped without
editing a page. tests/test_docs.py checks that every public name lands in the built
reference.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]
#: page -> (title, packages whose modules it documents, single modules it documents);
#: api/xopt.md also takes every top-level module, and every package no other page has
AREAS = {
    "api/xopt.md": ("xopt", (), ("xopt",)),
    "api/specs.md": ("xopt.specs", ("xopt.specs",), ()),
    "api/torch.md": ("xopt.torch", ("xopt.torch",), ()),
    "api/jax.md": ("xopt.jax", ("xopt.jax",), ()),
    "api/parity.md": ("xopt.parity", ("xopt.parity",), ()),
    "api/checkpoints.md": ("xopt.checkpoints", ("xopt.checkpoints",), ()),
    "api/kernels.md": ("xopt.kernels", ("xopt.kernels",), ()),
}


def public_modules(package: str) -> list[str]:
    """``package`` and every module below it whose dotted path has no ``_``-prefixed part,
    in path order (the package first)."""
    base = ROOT.joinpath(*package.split("."))
    found = []
    for path in sorted(base.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if any(p.startswith("_") for p in parts):
            continue
        found.append(".".join(parts))
    return sorted(found, key=lambda m: (m != package, m))


def top_level() -> tuple[list[str], list[str]]:
    """xopt's public top-level modules, and its public packages that no page lists."""
    listed = {pkg for _, packages, _ in AREAS.values() for pkg in packages}
    modules, packages = [], []
    for path in sorted((ROOT / "xopt").iterdir()):
        if path.name.startswith(("_", ".")):
            continue
        if path.suffix == ".py":
            modules.append(f"xopt.{path.stem}")
        elif (path / "__init__.py").is_file() and f"xopt.{path.name}" not in listed:
            packages.append(f"xopt.{path.name}")
    return modules, packages


def page(title: str, packages: tuple[str, ...], modules: tuple[str, ...]) -> str:
    if title == "xopt":
        extra_modules, extra_packages = top_level()
        modules, packages = (*modules, *extra_modules), (*packages, *extra_packages)
    names = list(modules) + [m for pkg in packages for m in public_modules(pkg)]
    lines = [f"# `{title}`", "",
             "Generated from the docstrings (every public module and name).", ""]
    for name in names:
        lines += [f"::: {name}", ""]
    return "\n".join(lines)


def on_files(files, config):
    for uri, (title, packages, modules) in AREAS.items():
        files.append(File.generated(config, uri, content=page(title, packages, modules)))
    return files
