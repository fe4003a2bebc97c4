"""Launching POET-X's Triton kernels with less host work per launch.

``kernel[grid](*args, **meta)`` runs ``JITFunction.run`` on every call: it binds and
specialises every argument, builds the kernel cache's key, checks the kernel's globals and
builds the launch metadata before it reaches the compiled kernel's launcher. An eager
POETLinear forward+backward issues 7 such launches, and its pace is set by the host
(:mod:`xopt.torch.poet`). :func:`launch` keeps, per kernel, the compiled kernel that
``JITFunction.run`` returned for a call, under a key that holds everything Triton
specialises the compilation on (each tensor's dtype and 16-byte alignment, the exact value
of every int, the constexprs and options), and launches later calls with the same key
through the compiled kernel's launcher directly: the call ``JITFunction.run`` itself makes.

The direct call depends on Triton's launcher convention, ``compiled.run(grid_x, grid_y,
grid_z, stream, compiled.function, compiled.packed_metadata, launch_metadata, enter_hook,
exit_hook, *bound_args)`` with every parameter's value bound in signature order (so
``JITFunction.run`` reads in 3.9 and in a 3.4-era source; older releases passed the
non-constexpr arguments only). It is used only where the installed ``JITFunction.run``
makes exactly that call (read from its source once), never under the interpreter or while
torch.compile traces, and not with launch hooks (profilers) or pre-run hooks installed;
everywhere else, and for any argument that is not a tensor, an int, a bool or a float,
:func:`launch` is ``kernel[grid](...)``. :data:`ENABLED` (``XOPT_POET_DIRECT_LAUNCH=0``
turns it off) switches it at run time.
"""

from __future__ import annotations

import inspect
import os
import re

import torch

__all__ = ["ENABLED", "OBSERVER", "launch", "matches"]

#: launch through the compiled kernel's launcher where the convention is the known one
ENABLED = os.environ.get("XOPT_POET_DIRECT_LAUNCH", "1") not in ("", "0")

#: called as ``OBSERVER(name, thunk)`` around each direct launch when set (the launch
#: counter of :mod:`xopt.kernels.poet_launches`; the ``kernel[grid]`` path it sees itself)
OBSERVER = None

#: the call JITFunction.run must make for the direct launch to be the same launch
_CALL = ("kernel.run(grid_0,grid_1,grid_2,stream,kernel.function,kernel.packed_metadata,"
         "launch_metadata,knobs.runtime.launch_enter_hook,knobs.runtime.launch_exit_hook,"
         "*bound_args.values())")
_state: dict = {}  # "ok": bool, "driver", "knobs" once checked
#: kernel -> {key: (compiled kernel, names of the parameters given in ``meta``) or None}
_CACHES: dict = {}
_CACHE_MAX = 4096


def _convention_ok() -> bool:
    ok = _state.get("ok")
    if ok is None:
        ok = False
        try:
            from triton import knobs
            from triton.runtime import driver, jit

            if matches(inspect.getsource(jit.JITFunction.run)):
                _state.update(driver=driver, knobs=knobs)
                ok = True
        except Exception:  # no source, another layout: the ordinary launch
            ok = False
        _state["ok"] = ok
    return ok


def matches(run_source: str) -> bool:
    """Whether the source of a ``JITFunction.run`` launches with the convention used here."""
    src = re.sub(r"\s+", "", run_source)
    return _CALL in src and "launch_metadata=kernel.launch_metadata(" in src


def _no_hooks() -> bool:
    rt = _state["knobs"].runtime
    for hook in (rt.launch_enter_hook, rt.launch_exit_hook):
        # None (older releases) or an empty HookChain (3.9)
        if hook is not None and getattr(hook, "calls", True):
            return False
    return True


def _spec(a):
    """What Triton specialises a compilation on for one argument (None: not supported)."""
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if isinstance(a, (bool, int)):
        return (type(a), a)
    if isinstance(a, float):
        return float
    return None


def launch(kernel, grid: tuple, *args, **meta) -> None:
    """``kernel[grid](*args, **meta)``, launched directly where it can be (module docstring).
    ``args``: the kernel's leading parameters, positional; ``meta``: its constexprs (by
    name, after ``args`` in its signature) and launch options (``num_warps``, ...)."""
    if not ENABLED or torch.compiler.is_compiling() or not _direct_ok(kernel):
        # (torch.compile traces kernel[grid](...) as a user-defined Triton kernel)
        kernel[grid](*args, **meta)
        return
    drv = _state["driver"].active
    device = drv.get_current_device()
    specs = tuple(_spec(a) for a in args)
    if None in specs or not _no_hooks():
        kernel[grid](*args, **meta)
        return
    key = (device, specs, tuple(meta.items()))
    cache = _CACHES.setdefault(kernel, {})
    hit = cache.get(key, False)
    if hit is False:  # first call with this key: the ordinary launch, which compiles
        compiled = kernel[grid](*args, **meta)
        names = tuple(kernel.arg_names[len(args):])
        if len(cache) >= _CACHE_MAX:
            cache.clear()
        direct = (compiled is not None and hasattr(compiled, "packed_metadata")
                  and all(n in meta for n in names))
        cache[key] = (compiled, names) if direct else None
        return
    if hit is None:
        kernel[grid](*args, **meta)
        return
    compiled, names = hit
    bound = (*args, *(meta[n] for n in names))
    stream = drv.get_current_stream(device)
    grid = (*grid, 1, 1)
    rt = _state["knobs"].runtime
    args = (grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata,
            None, rt.launch_enter_hook, rt.launch_exit_hook, *bound)
    if OBSERVER is None:
        compiled.run(*args)
    else:
        OBSERVER(kernel.__name__, lambda: compiled.run(*args))


def _direct_ok(kernel) -> bool:
    """A compiled-mode JITFunction, the known convention, no pre-run hooks."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    if not hasattr(kernel, "arg_names") or getattr(kernel, "pre_run_hooks", None):
        return False
    return _convention_ok() and type(kernel).__name__ == "JITFunction"
