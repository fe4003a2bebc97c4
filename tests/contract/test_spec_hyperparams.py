"""Every field of every registered method's hyperparameters is validated alike
(xopt/specs/_hyperparams.py): NaN and ±inf refused naming the field, integer bounds exact,
ranges listed as the field's kind of number. Both backends take these dataclasses, so a
value refused here is refused by every optimizer of both."""

from __future__ import annotations

import dataclasses
import math
import numbers

import pytest

from xopt import specs
from xopt.errors import HyperparameterError
from xopt.specs._hyperparams import is_integer_field


def _numeric_fields():
    for name in specs.names():
        cls = specs.get(name).hyperparams
        for f in dataclasses.fields(cls):
            if f.metadata.get("choices") is not None or isinstance(f.default, (bool, str)):
                continue
            if isinstance(f.default, tuple):
                yield pytest.param(cls, f, id=f"{name}.{f.name}")
            elif isinstance(f.default, numbers.Real) or f.metadata.get("interval"):
                yield pytest.param(cls, f, id=f"{name}.{f.name}")


FIELDS = list(_numeric_fields())

#: fields a method requires (no default that stands alone)
REQUIRED = {"coap": dict(rank=2), "flora": dict(lr=1e-2)}


def test_every_method_has_numeric_fields_under_test():
    assert {p.id.split(".")[0] for p in FIELDS} == set(specs.names())


@pytest.mark.parametrize("cls,field", FIELDS)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_non_finite_values_are_refused_naming_the_field(cls, field, bad):
    assert not field.metadata.get("allow_inf")  # no field of any method means "unbounded"
    value = (bad,) * len(field.default) if isinstance(field.default, tuple) else bad
    with pytest.raises(HyperparameterError, match=rf"{cls.__name__}\.{field.name} = "):
        cls(**{field.name: value})


INT_BOUNDED = [p for p in FIELDS if is_integer_field(p.values[1])
               and getattr(p.values[1].metadata.get("interval"), "hi", None) is not None]


@pytest.mark.parametrize("cls,field", INT_BOUNDED)
def test_integer_fields_compare_exactly_with_their_upper_bound(cls, field):
    # seeds up to 2**64 - 1: a comparison through float would round the bound up to 2**64
    hi = field.metadata["interval"].hi
    assert isinstance(hi, int), f"{cls.__name__}.{field.name}: integer bound written as {hi!r}"
    base = REQUIRED.get(cls.METHOD, {})
    assert getattr(cls(**base, **{field.name: hi}), field.name) == hi
    with pytest.raises(HyperparameterError,
                       match=rf"{cls.__name__}\.{field.name} = {hi + 1}: must be in \[0, {hi}\]"):
        cls(**base, **{field.name: hi + 1})


@pytest.mark.parametrize("name", specs.names())
def test_describe_writes_integer_ranges_as_integers(name):
    cls = specs.get(name).hyperparams
    table = cls.describe()
    assert "e+" not in table
    for f in dataclasses.fields(cls):
        interval = f.metadata.get("interval")
        if is_integer_field(f) and interval is not None:
            line = next(row for row in table.splitlines() if row.split()[0] == f.name)
            assert interval.format(integer=True) in line and ".0" not in line.split(")")[0]
