"""Every Triton launch in ``xopt/kernels`` passes ``**FP_FUSION`` (float32 ``a·b + c``
contracted to FMA, as the kernels were measured; Triton 3.10 turns it off by default), or
``**NO_FP_FUSION`` where its bytes must be another path's (xopt.kernels.quant8).

A launch is a call whose callee is a subscript by a grid, ``kernel[grid](...)`` (not by a
string: ``table["fn"](...)`` calls a stored function), or a call of
:func:`xopt.kernels.poet_jit.launch`, ``launch(kernel, grid, ...)``; the check reads the
modules' syntax trees (no Triton needed) and names each launch that lacks the option.
"""

from __future__ import annotations

import ast

from helpers import REPO

KERNELS = REPO / "xopt" / "kernels"


def _launches(tree: ast.AST):
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                and not (isinstance(node.func.slice, ast.Constant)
                         and isinstance(node.func.slice.value, str))):
            yield node
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id == "launch" and len(node.args) >= 2):
            yield node


def test_every_kernel_launch_pins_fp_fusion():
    missing, found = [], 0
    for path in sorted(KERNELS.glob("*.py")):
        if path.name == "poet_jit.py":  # launch() forwards its callers' options (**meta)
            continue
        for call in _launches(ast.parse(path.read_text())):
            found += 1
            if not any(k.arg is None and isinstance(k.value, ast.Name)
                       and k.value.id in ("FP_FUSION", "NO_FP_FUSION")
                       for k in call.keywords):
                missing.append(f"{path.name}:{call.lineno}")
    assert found >= 20, found  # the launches exist (the scan is not looking at nothing)
    assert not missing, missing


def test_fp_fusion_is_the_enabled_option():
    import xopt.kernels as k

    assert k.FP_FUSION == {"enable_fp_fusion": True}
    assert k.NO_FP_FUSION == {"enable_fp_fusion": False}
