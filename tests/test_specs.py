"""The specification layer: registry, hyperparameter validation, JSON, state schema."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from xopt import specs
from xopt.errors import HyperparameterError, StateError, UnknownMethodError
from xopt.specs import adamw


def test_registry_lists_and_returns_methods():
    assert "adamw" in specs.names()
    spec = specs.get("adamw")
    assert spec.name == "adamw" and spec.hyperparams is adamw.AdamW


def test_unknown_method_names_it_and_the_known_ones():
    with pytest.raises(UnknownMethodError, match=r"'velox'.*known methods: .*adamw"):
        specs.get("velox")


def test_defaults_are_torch_optim_adamw_defaults():
    import inspect

    torch = pytest.importorskip("torch")
    sig = inspect.signature(torch.optim.AdamW.__init__).parameters
    h = adamw.AdamW()
    assert h.lr == sig["lr"].default
    assert (h.b1, h.b2) == sig["betas"].default
    assert h.eps == sig["eps"].default
    assert h.weight_decay == sig["weight_decay"].default


def test_optax_preset_defaults_are_optax_adamw_defaults():
    import inspect

    optax = pytest.importorskip("optax")
    sig = inspect.signature(optax.adamw).parameters
    h = specs.get("adamw").make("optax")
    for name in ("b1", "b2", "eps", "eps_root", "weight_decay", "nesterov"):
        assert getattr(h, name) == sig[name].default, name


@pytest.mark.parametrize("field,value,pattern", [
    ("b1", 1.0, r"AdamW\.b1 = 1\.0: must be in \[0\.0, 1\.0\)"),
    ("b2", -0.1, r"AdamW\.b2 = -0\.1: must be in"),
    ("lr", -1e-3, r"AdamW\.lr = -0\.001: must be in \[0\.0, inf\)"),
    ("eps", float("nan"), r"AdamW\.eps = nan"),
    ("lr", "0.1", r"AdamW\.lr = '0\.1': must be a real number"),
    ("amsgrad", 1, r"AdamW\.amsgrad = 1: must be a bool"),
    ("formula", "jax", r"AdamW\.formula = 'jax': must be one of 'torch', 'optax'"),
])
def test_validation_names_field_and_range(field, value, pattern):
    with pytest.raises(HyperparameterError, match=pattern):
        adamw.AdamW(**{field: value})


def test_nesterov_needs_optax_formula():
    with pytest.raises(HyperparameterError, match="nesterov.*formula='optax'"):
        adamw.AdamW(nesterov=True)
    assert adamw.AdamW(nesterov=True, formula="optax").nesterov


def test_unknown_hyperparameter_is_named():
    with pytest.raises(HyperparameterError, match=r"unknown hyperparameter 'beta1' for adamw"):
        specs.get("adamw").make("torch", beta1=0.9)
    with pytest.raises(HyperparameterError, match=r"'momentum'"):
        adamw.AdamW.from_dict({"lr": 0.1, "momentum": 0.9})


def test_replace_validates():
    with pytest.raises(HyperparameterError, match="AdamW.b2"):
        adamw.AdamW().replace(b2=2.0)
    with pytest.raises(HyperparameterError, match="'bogus'"):
        adamw.AdamW().replace(bogus=1)


@pytest.mark.parametrize("h", [
    adamw.AdamW(),
    adamw.AdamW(lr=0.1 + 0.2, b1=1 / 3, eps=5e-324, weight_decay=1.7976931348623157e308),
    specs.get("adamw").make("optax", lr=3e-4, nesterov=True, eps_root=1e-30),
])
def test_json_round_trip_is_lossless(h):
    text = h.to_json()
    back = adamw.AdamW.from_json(text)
    assert back == h
    for f in dataclasses.fields(h):
        a, b = getattr(h, f.name), getattr(back, f.name)
        assert type(a) is type(b) and (a == b), f.name
    assert json.loads(text)["format"] == "xopt-spec/1"


def test_from_json_rejects_other_methods_and_formats():
    with pytest.raises(HyperparameterError, match="'method' is 'velo'"):
        adamw.AdamW.from_json(json.dumps({"format": "xopt-spec/1", "method": "velo",
                                          "hyperparameters": {}}))
    with pytest.raises(HyperparameterError, match="format"):
        adamw.AdamW.from_json("{}")
    with pytest.raises(HyperparameterError, match="not valid JSON"):
        adamw.AdamW.from_json("{")


def test_array_scalars_are_accepted_and_checked_when_concrete():
    assert adamw.AdamW(lr=np.float32(0.5)).lr == np.float32(0.5)
    with pytest.raises(HyperparameterError, match="AdamW.lr"):
        adamw.AdamW(lr=np.array(-1.0))


def test_state_schema_round_trips_between_namings():
    spec = specs.get("adamw")
    h = adamw.AdamW(amsgrad=True)
    params = {"a/w": (3, 2), "b": ()}
    rng = np.random.default_rng(0)
    canonical = {"step": np.int64(4)}
    for k, shape in spec.state.canonical_keys(params, h).items():
        if k != "step":
            canonical[k] = rng.standard_normal(shape).astype(np.float32)
    names = list(params)
    for naming in spec.state.namings:
        flat = spec.state.from_canonical(naming, canonical, names, h)
        back = spec.state.to_canonical(naming, flat, names, h)
        assert back.keys() == canonical.keys()
        for k in canonical:
            assert np.array_equal(back[k], canonical[k]), (naming, k)
    flat = spec.state.from_canonical("torch.optim", canonical, names, h)
    assert flat["a/w/exp_avg"].shape == (3, 2) and flat["b/step"].dtype == np.float32


def test_state_schema_errors_name_the_key():
    spec = specs.get("adamw")
    h = adamw.AdamW()
    flat = {"w/step": np.float32(1), "w/exp_avg": np.zeros(2), "w/exp_avg_sq": np.zeros(2)}
    with pytest.raises(StateError, match="missing 'w/exp_avg_sq'"):
        spec.state.to_canonical("torch.optim", {k: v for k, v in flat.items()
                                                if k != "w/exp_avg_sq"}, ["w"], h)
    with pytest.raises(StateError, match="unexpected state key.*w/extra"):
        spec.state.to_canonical("torch.optim", {**flat, "w/extra": np.zeros(1)}, ["w"], h)
    two = {**flat, "u/step": np.float32(2), "u/exp_avg": np.zeros(1), "u/exp_avg_sq": np.zeros(1)}
    with pytest.raises(StateError, match="global and must agree"):
        spec.state.to_canonical("torch.optim", two, ["w", "u"], h)
    canonical = spec.state.to_canonical("torch.optim", flat, ["w"], h)
    with pytest.raises(StateError, match=r"'m/w' has shape \(2,\), expected \(3,\)"):
        spec.state.check_canonical(canonical, {"w": (3,)}, h, where="test")


def test_bias_correction_conventions():
    # float64: the double-precision value; float32: optax's float32 arithmetic.
    exact = 1 - 0.999**2
    assert adamw.bias_correction(0.999, 2, "float64", np) == exact
    f32 = adamw.bias_correction(0.999, 2, "float32", np)
    assert f32.dtype == np.float32
    expected = np.float32(1) - np.float32(np.float64(np.float32(0.999)) ** 2)
    assert f32 == expected
    # optax's float32 cancellation is real and large here: ~1e-5 relative.
    assert 1e-6 < abs(float(f32) - exact) / exact < 1e-4
