"""`import xopt` is cheap: no framework is imported, and it takes under 100 ms."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers import REPO

HEAVY = ("torch", "jax", "jaxlib", "flax", "optax", "triton")


def _probe(statement: str) -> dict:
    code = (
        "import json, sys, time\n"
        "t0 = time.perf_counter()\n"
        f"{statement}\n"
        "wall = time.perf_counter() - t0\n"
        f"print(json.dumps({{'wall': wall, 'heavy': [m for m in {HEAVY!r} if m in sys.modules]}}))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout)


LIGHT_STACK = ("import xopt, xopt.specs, xopt.parity, xopt.random, xopt.cli\n"
               "from xopt.specs import adamw\n"
               "xopt.specs.get('adamw'); xopt.cli.build_parser()")


def test_import_xopt_imports_no_framework():
    assert _probe("import xopt")["heavy"] == []
    # The framework-neutral layers stay framework-free too.
    assert _probe(LIGHT_STACK)["heavy"] == []


def test_import_xopt_is_fast():
    # Best of five fresh interpreters: the import itself, not a cold disk cache or a
    # neighbour's load on a 2-core CI machine.
    best = min(_probe("import xopt")["wall"] for _ in range(5))
    print(f"import xopt: {best * 1e3:.1f} ms (best of 5)")
    assert best < 0.100, f"import xopt took {best * 1e3:.1f} ms"


def test_framework_packages_load_on_demand():
    code = ("import sys, xopt; xopt.torch.AdamW; "
            "print('torch' in sys.modules, 'jax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True,
                         capture_output=True, text=True)
    assert out.stdout.split() == ["True", "False"]
