"""Counting the device-kernel launches of a call on the host: POET-X's eager cost.

An eager POETLinear forward+backward is paced by the host, which issues one launch per
kernel (:mod:`xopt.torch.poet`), so its launch count is the CPU-checkable proxy of its
eager time. :func:`count_launches` runs a callable and counts

* ``aten``: ATen calls that launch a device kernel (every call seen by a
  ``TorchDispatchMode`` except views and bare allocations),
* ``host``: the other ATen calls (views, ``empty``: host work, no kernel),
* ``triton``: Triton launches (compiled, or under ``TRITON_INTERPRET=1`` interpreted; those
  :mod:`xopt.kernels.poet_jit` makes through the compiled kernel too), whose own ATen
  traffic (the interpreter's copies) is not counted.

It counts the same on the CPU and on a GPU: the test bounding the layer's launches
(tests/test_poet_launches.py) and ``bench/poet_layer.py`` both use it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["LaunchCount", "count_launches"]

#: ATen calls that launch no kernel besides the views: bare allocations, and views that
#: ATen does not mark as views (``_unsafe_view``, ``lift_fresh``)
_ALLOC = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                    "_unsafe_view", "lift_fresh"})


@dataclasses.dataclass
class LaunchCount:
    aten: collections.Counter
    host: collections.Counter
    triton: collections.Counter
    #: how many of the Triton launches went through poet_jit's direct path
    direct: int = 0

    @property
    def launches(self) -> int:
        """Device kernels launched: ATen kernels plus Triton launches."""
        return sum(self.aten.values()) + sum(self.triton.values())

    def __str__(self) -> str:
        def fmt(c):
            return ", ".join(f"{k} {v}" for k, v in sorted(c.items()))

        return (f"{self.launches} launches (aten {sum(self.aten.values())}: {fmt(self.aten)}; "
                f"triton {sum(self.triton.values())}: {fmt(self.triton)}; {self.direct} "
                f"direct); "
                f"{sum(self.host.values())} host-only aten calls ({fmt(self.host)})")


class _Count(TorchDispatchMode):
    def __init__(self, count: LaunchCount, inside: list):
        super().__init__()
        self.count, self.inside = count, inside

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside[0]:
            name = func.overloadpacket.__name__
            host = func.is_view or name in _ALLOC
            (self.count.host if host else self.count.aten)[name] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _triton_hooks(count: LaunchCount, inside: list):
    """Wrap the ``run`` of Triton's kernel classes (compiled and interpreted) to count
    launches (not warm-ups) and to mark the time spent inside them."""
    patched = []
    try:
        from triton.runtime import interpreter, jit

        classes = (jit.JITFunction, interpreter.InterpretedFunction)
    except ImportError:  # no Triton: nothing to count
        classes = ()
    for cls in classes:
        orig = cls.run

        def run(self, *args, _orig=orig, **kwargs):
            if not kwargs.get("warmup", False):
                count.triton[getattr(self, "__name__", None) or self.fn.__name__] += 1
            inside[0] += 1
            try:
                return _orig(self, *args, **kwargs)
            finally:
                inside[0] -= 1

        cls.run = run
        patched.append((cls, orig))
    from xopt.kernels import poet_jit

    def observe(name, go):  # the launches poet_jit makes through the compiled kernel
        count.triton[name] += 1
        count.direct += 1
        inside[0] += 1
        try:
            go()
        finally:
            inside[0] -= 1

    before = poet_jit.OBSERVER
    poet_jit.OBSERVER = observe
    try:
        yield
    finally:
        poet_jit.OBSERVER = before
        for cls, orig in patched:
            cls.run = orig


def count_launches(fn, *args, **kwargs) -> LaunchCount:
    """Run ``fn(*args, **kwargs)`` once and count its launches (see the module docstring).
    Run it once beforehand where first calls differ (compilation, caches)."""
    count = LaunchCount(collections.Counter(), collections.Counter(), collections.Counter())
    inside = [0]
    with _triton_hooks(count, inside), _Count(count, inside):
        fn(*args, **kwargs)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return count
