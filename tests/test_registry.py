"""The backend registry and the harness's per-method modules: every method has both backends
and a ``PARITY``, found by name; specs name no backend; nothing loads a framework early."""

from __future__ import annotations

import ast
import re
import subprocess
import sys

import pytest
from helpers import REPO, needs_jax, needs_torch

from xopt import registry, specs
from xopt.errors import UnknownMethodError
from xopt.parity import methods

#: a ``"module:attr"`` reference into the layers above the specs
REFERENCE = re.compile(r"xopt\.(torch|jax|parity|kernels)(\.\w+)*:[\w.]+")


@needs_torch
def test_every_method_registers_its_torch_implementation():
    import torch

    for name in specs.names():
        impl = registry.implementation(name, "torch")
        assert issubclass(impl.factory, torch.optim.Optimizer), name
        assert impl.factory.__module__ == f"xopt.torch.{name}"


@needs_jax
def test_every_method_registers_its_jax_implementation():
    for name in specs.names():
        impl = registry.implementation(name, "jax")
        assert callable(impl.factory) and impl.factory.__module__ == f"xopt.jax.{name}", name


def test_unknown_pairs_and_conflicts_are_errors():
    with pytest.raises(UnknownMethodError, match="no torch implementation of 'nope'"):
        registry.implementation("nope", "torch")
    with pytest.raises(UnknownMethodError, match="no mx implementation of 'adamw'"):
        registry.implementation("adamw", "mx")

    def first(params):
        return params

    def second(params):
        return params

    try:
        assert registry.register("toy_method", "mx", first) is first
        assert registry.implementation("toy_method", "mx").factory is first
        with pytest.raises(ValueError, match="already registered"):
            registry.register("toy_method", "mx")(second)
        registry.register("toy_method", "mx", first)  # the same object again: allowed
    finally:
        registry._REGISTRY.pop(("toy_method", "mx"), None)


def test_every_method_has_its_harness_module():
    for name in specs.names():
        parity = methods.get(name)
        assert parity.method == name and parity.spec is specs.get(name)
        assert {"teacher_forced", "closed_loop", "bitwise"} <= set(parity.tolerances)
        for key, o in parity.originals.items():
            assert key == o.name and (isinstance(o.naming, specs.Naming) or callable(o.naming))
            assert ":" in o.factory and (not o.preset or o.preset in parity.spec.presets)
    with pytest.raises(UnknownMethodError, match="known methods"):
        methods.get("nope")


def test_method_names_are_the_spec_modules_that_define_a_spec():
    import importlib

    files = {p.stem for p in (REPO / "xopt" / "specs").glob("*.py") if not p.stem.startswith("_")}
    with_spec = {f for f in files
                 if hasattr(importlib.import_module(f"xopt.specs.{f}"), "SPEC")}
    assert set(specs.names()) == with_spec and files - with_spec == set(specs.SHARED)


def test_specs_name_no_backend():
    """No spec module imports a backend or the harness, and none holds a ``"module:attr"``
    reference to one."""
    for path in sorted((REPO / "xopt" / "specs").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith(("xopt.torch", "xopt.jax", "xopt.parity",
                                                   "xopt.registry")), (path.name, node.module)
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert not REFERENCE.fullmatch(node.value), (path.name, node.value)


def test_registry_and_harness_modules_import_no_framework():
    code = ("import sys, xopt.registry, xopt.parity.methods as m, xopt.specs as s\n"
            "[m.get(n) for n in s.names()]\n"
            "print([k for k in ('torch', 'jax', 'optax', 'flax') if k in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True,
                         capture_output=True, text=True)
    assert out.stdout.split() == ["[]"]
