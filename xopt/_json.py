"""Strict JSON for files xopt reads from elsewhere (checkpoint configs, trace manifests).

Before :func:`json.loads` sees the text, its nesting is measured (NumPy, no recursion) and
refused beyond ``max_depth``; a duplicate key is refused while parsing, and afterwards a
non-finite number (``NaN``, ``Infinity``, ``1e999``) or an integer beyond ``2**62``, naming
where it is (``key 'a.b[2]'``). Every failure is an ``error`` (the caller's
:class:`xopt.errors.XoptError` subclass) naming the file.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import numpy as np

MAX_DEPTH = 32
MAX_INT = 1 << 62


def max_depth(data: bytes) -> int:
    """Deepest bracket nesting of JSON text, strings excluded."""
    stripped = re.sub(rb'"(?:[^"\\]|\\.)*"', b"", data)
    if not stripped:
        return 0
    a = np.frombuffer(stripped, np.uint8)
    delta = ((a == ord("[")).astype(np.int64) + (a == ord("{"))
             - (a == ord("]")) - (a == ord("}")))
    return int(np.cumsum(delta).max(initial=0))


def loads(data: bytes, file: str, error: type[Exception], *,
          max_depth_: int = MAX_DEPTH) -> Any:
    """Parse ``data`` (UTF-8 JSON) strictly; see the module docstring."""

    def fail(msg: str) -> Exception:
        return error(f"{file}: {msg}")

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in items:
            if k in out:
                raise fail(f"key {k!r} appears twice in one object")
            out[k] = v
        return out

    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise fail(f"not UTF-8 ({e})") from None
    if max_depth(data) > max_depth_:
        raise fail(f"JSON nested deeper than {max_depth_} levels")
    try:
        doc = json.loads(text, object_pairs_hook=pairs)
    except error:
        raise
    except (ValueError, RecursionError) as e:  # ValueError: also ints beyond 4300 digits
        raise fail(f"not valid JSON ({e})") from None
    stack: list[tuple[str, Any]] = [("", doc)]
    while stack:
        where, v = stack.pop()
        if isinstance(v, dict):
            stack += [(f"{where}.{k}" if where else k, x) for k, x in v.items()]
        elif isinstance(v, list):
            stack += [(f"{where}[{i}]", x) for i, x in enumerate(v)]
        elif isinstance(v, float) and not math.isfinite(v):
            raise fail(f"key {where!r} is {v}, not a finite number")
        elif isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_INT:
            digits = str(v)
            raise fail(f"key {where!r} is {digits[:24]}{'...' * (len(digits) > 24)}, out of "
                       "range (|x| <= 2**62)")
    return doc
