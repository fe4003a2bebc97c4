"""Hyperparameter dataclasses: defaults, validation that names the field, lossless JSON.

Every method's hyperparameters are a frozen dataclass deriving from :class:`Hyperparams`.
Fields are declared with :func:`hp` so that each carries its allowed range or choices and
a one-line description; validation runs in ``__post_init__`` and therefore also on
``dataclasses.replace``.

Numeric fields accept Python numbers and, so that ``optax.inject_hyperparams`` and torch's
tensor learning rates work, 0-d arrays (jax tracers, torch tensors, NumPy scalars). A
concrete value is range-checked; a traced one cannot be and is accepted as is. Every
concrete number, and every element of a tuple of numbers, must be finite: NaN and ±inf
are refused naming the field (no field of any method means "unbounded" by inf; a field
that did would say so with ``hp(..., allow_inf=True)``). Integer fields are compared with
their bounds exactly (not through a float, which would round 2**64 − 1 up).

JSON: ``to_json`` writes ``{"format": "xopt-spec/1", "method": ..., "hyperparameters":
{...}}``. Python's float repr is the shortest string that reads back to the same double, so
``from_json(to_json(h)) == h`` holds bit for bit (``inf`` of a field that allows it is
written as ``Infinity``, which Python's json reads back).
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from collections.abc import Mapping
from typing import Any, ClassVar

from xopt.errors import HyperparameterError

SPEC_FORMAT = "xopt-spec/1"


@dataclasses.dataclass(frozen=True)
class Interval:
    """A real interval with open or closed ends; ``None`` is an infinite end."""

    lo: float | None = None
    hi: float | None = None
    lo_closed: bool = True
    hi_closed: bool = True

    def __contains__(self, x: float) -> bool:
        if math.isnan(x):
            return False
        if self.lo is not None and (x < self.lo or (x == self.lo and not self.lo_closed)):
            return False
        if self.hi is not None and (x > self.hi or (x == self.hi and not self.hi_closed)):
            return False
        return True

    def __str__(self) -> str:
        return self.format()

    def format(self, integer: bool = False) -> str:
        """``[lo, hi)`` etc.; ``integer``: the bounds of an integer field, written as ints."""
        def bound(x: float | None, inf: str) -> str:
            if x is None:
                return inf
            if integer and float(x).is_integer():
                return str(int(x))
            return repr(x)

        left = "[" if self.lo_closed and self.lo is not None else "("
        right = "]" if self.hi_closed and self.hi is not None else ")"
        return f"{left}{bound(self.lo, '-inf')}, {bound(self.hi, 'inf')}{right}"


NONNEGATIVE = Interval(0.0, None)
POSITIVE = Interval(0.0, None, lo_closed=False)
UNIT_HALF_OPEN = Interval(0.0, 1.0, hi_closed=False)  # [0, 1): EMA decays


def hp(default: Any, *, doc: str, interval: Interval | None = None, choices: tuple | None = None,
       allow_inf: bool = False):
    """Declare a hyperparameter field with its default, description and allowed values
    (``allow_inf``: ±inf is a meaningful value of this field; NaN never is)."""
    return dataclasses.field(
        default=default, metadata={"doc": doc, "interval": interval, "choices": choices,
                                   "allow_inf": allow_inf}
    )


def is_integer_field(f: dataclasses.Field) -> bool:
    """Whether a field holds integers (its default is an int, or None under an ``int``
    annotation)."""
    d = f.default
    if isinstance(d, bool):
        return False
    if isinstance(d, numbers.Integral):
        return True
    return d is None and str(f.type).replace(" ", "").startswith("int")


def _is_array_scalar(value: Any) -> bool:
    """A 0-d array of any framework (duck-typed so no framework is imported)."""
    return hasattr(value, "shape") and hasattr(value, "dtype") and tuple(value.shape) == ()


def _concrete_float(value: Any) -> float | None:
    """The value as a float if it is concrete, ``None`` if it is traced (jax under jit)."""
    if isinstance(value, numbers.Real):
        return float(value)
    try:
        return float(value)
    except Exception:  # a jax tracer, or a tensor that cannot be read without a sync
        return None


@dataclasses.dataclass(frozen=True)
class Hyperparams:
    """Base of every method's hyperparameter dataclass.

    Subclasses set ``METHOD`` (the registry name) and declare fields with :func:`hp`.
    """

    METHOD: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            self._check_field(f, getattr(self, f.name))
        self._check_combinations()

    # -- validation ---------------------------------------------------------------------
    def _fail(self, field: str, value: Any, why: str) -> HyperparameterError:
        return HyperparameterError(f"{type(self).__name__}.{field} = {value!r}: {why}")

    def _check_field(self, f: dataclasses.Field, value: Any) -> None:
        meta = f.metadata
        default = f.default
        choices = meta.get("choices")
        if choices is not None:
            if value not in choices:
                allowed = ", ".join(repr(c) for c in choices)
                raise self._fail(f.name, value, f"must be one of {allowed}")
            return
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise self._fail(f.name, value, "must be a bool")
            return
        if isinstance(default, str):
            if not isinstance(value, str):
                raise self._fail(f.name, value, "must be a str")
            return
        if isinstance(default, tuple) and default and all(
                isinstance(x, numbers.Real) and not isinstance(x, bool) for x in default):
            if not isinstance(value, (tuple, list)) or not all(
                    isinstance(x, numbers.Real) and not isinstance(x, bool) for x in value):
                raise self._fail(f.name, value, "must be a tuple of real numbers")
            if not all(math.isfinite(x) for x in value):
                raise self._fail(f.name, value, "every element must be finite")
            return
        if isinstance(default, numbers.Real) or default is None and meta.get("interval"):
            if value is None and default is None:
                return
            if isinstance(value, bool) or not (
                isinstance(value, numbers.Real) or _is_array_scalar(value)
            ):
                raise self._fail(f.name, value, "must be a real number")
            if isinstance(default, int) and not isinstance(default, bool):
                if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):
                    raise self._fail(f.name, value, "must be an integer")
            interval = meta.get("interval")
            x = _concrete_float(value)
            if x is not None and not math.isfinite(x) and not (
                    meta.get("allow_inf") and not math.isnan(x)):
                raise self._fail(f.name, value, "must be finite")
            if isinstance(value, numbers.Integral):
                x = int(value)  # exact comparison with the bounds
            if interval is not None and x is not None and x not in interval:
                raise self._fail(f.name, value,
                                 f"must be in {interval.format(is_integer_field(f))}")

    def _check_combinations(self) -> None:
        """Checks that involve several fields; subclasses override."""

    # -- construction -------------------------------------------------------------------
    def replace(self, **changes: Any) -> Hyperparams:
        """A validated copy with ``changes`` applied; unknown names are an error."""
        self._reject_unknown(changes)
        return dataclasses.replace(self, **changes)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def _reject_unknown(cls, names: Mapping[str, Any] | set[str]) -> None:
        unknown = sorted(set(names) - set(cls.field_names()))
        if unknown:
            raise HyperparameterError(
                f"unknown hyperparameter{'s' if len(unknown) > 1 else ''} "
                f"{', '.join(repr(u) for u in unknown)} for {cls.METHOD or cls.__name__}; "
                f"known: {', '.join(cls.field_names())}"
            )

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> Hyperparams:
        """Build from a mapping of field names (as written by :meth:`to_dict`)."""
        cls._reject_unknown(values)
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name in values:
                v = values[f.name]
                kwargs[f.name] = tuple(v) if isinstance(v, list) else v
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if _is_array_scalar(v):
                v = _concrete_float(v)
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out

    def to_json(self, **dumps_kwargs: Any) -> str:
        doc = {"format": SPEC_FORMAT, "method": self.METHOD, "hyperparameters": self.to_dict()}
        return json.dumps(doc, **dumps_kwargs)

    @classmethod
    def from_json(cls, text: str) -> Hyperparams:
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise HyperparameterError(f"{cls.__name__}.from_json: not valid JSON ({e})") from e
        if not isinstance(doc, dict) or doc.get("format") != SPEC_FORMAT:
            raise HyperparameterError(
                f"{cls.__name__}.from_json: expected 'format': {SPEC_FORMAT!r}, "
                f"got {doc.get('format') if isinstance(doc, dict) else type(doc).__name__!r}"
            )
        if doc.get("method") != cls.METHOD:
            raise HyperparameterError(
                f"{cls.__name__}.from_json: 'method' is {doc.get('method')!r}, "
                f"expected {cls.METHOD!r}"
            )
        hps = doc.get("hyperparameters")
        if not isinstance(hps, dict):
            raise HyperparameterError(f"{cls.__name__}.from_json: missing 'hyperparameters'")
        return cls.from_dict(hps)

    @classmethod
    def describe(cls) -> str:
        """A table of the fields: name, default, allowed values, description."""
        rows = []
        for f in dataclasses.fields(cls):
            m = f.metadata
            interval = m.get("interval")
            allowed = interval.format(is_integer_field(f)) if interval is not None else (
                "{" + ", ".join(map(repr, m["choices"])) + "}" if m.get("choices") else ""
            )
            rows.append(f"  {f.name:<16} {f.default!r:<12} {allowed!s:<16} {m.get('doc', '')}")
        return "\n".join(rows)
