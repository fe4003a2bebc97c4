"""POET-XQ parity: the authors' 8-bit W0 and its merges, replayed by both backends.

The case (tests/fixtures/parity/poet/xq_in64_out48_b16_g256.*, recorded by
tools/record_poet_xq.py from Sphere-AI-Lab/poet 3a34bb6, QPOETLinear, on the CPU with its
PyTorch Cayley fallback): ``from_linear`` (row normalisation and quantisation), then three
merges from seeded rotation vectors, each dequantising, merging and quantising afresh
with new ``torch.randperm`` permutations (injected here). Each merge is teacher-forced:
it starts from the recorded codes, scales, zero points and permutations.

Bounds (the issue's, for 8-bit state): byte-exact codes and zero points, and the
dequantised W0 within 1e-6 relative (torch: the scales and W0 bit for bit too; JAX: a
scale may sit one float32 ulp off, see the JAX test). The QPOETLinear forward and
backward need Triton on a GPU (their fallback raises), so the layer's products are
checked against the full-precision layer on the dequantised W0 instead
(tests/test_poet_xq.py), whose own forward and backward replay the authors' POET-X
traces (test_poet.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from helpers import has_torch, needs_jax, needs_torch

from xopt.specs import poet as P

if has_torch:
    import torch

    if not torch.cuda.is_available():  # before triton is imported: its CPU interpreter
        os.environ.setdefault("TRITON_INTERPRET", "1")

CASE = Path(__file__).resolve().parents[1] / "tests/fixtures/parity/poet/xq_in64_out48_b16_g256"
GS, B = 256, 16
NAMES = ("weight", "weight_scales", "weight_zeros")


@pytest.fixture(scope="module")
def rec():
    manifest = json.loads(CASE.with_suffix(".json").read_text())
    assert manifest["source"]["commit"].startswith("3a34bb6")
    with np.load(CASE.with_suffix(".npz")) as z:
        return {k: z[k] for k in z.files}


def _normalised(rec):
    """The authors' from_linear normalisation, in torch (its reduction order)."""
    w = rec["linear_weight"]
    t = torch.as_tensor(w)
    return (t / torch.norm(t, dim=1, keepdim=True)).numpy()  # the authors' from_linear


@needs_torch
def test_quantisation_is_byte_exact_in_numpy(rec):
    codes, scales, zeros = P.quantize_weight(_normalised(rec), GS)
    for name, got in zip(NAMES, (codes, scales, zeros), strict=True):
        np.testing.assert_array_equal(got, rec[f"init/{name}"])
    np.testing.assert_array_equal(P.dequantize_weight(codes, scales, zeros, GS),
                                  rec["init/dequantized"])


def _steps(rec):
    prev = "init"
    for k in range(3):
        yield prev, f"merge_{k}", k
        prev = f"merge_{k}"


@needs_torch
def test_torch_layer_replays_the_authors_merges(rec):
    from xopt.torch.poet import POETLinear

    lin = torch.nn.Linear(64, 48, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.as_tensor(rec["linear_weight"]))
    layer = POETLinear.from_linear(lin, B, weight_bits=8, weight_group_size=GS,
                                   cayley_formula="taylor", impl="plain")
    for name in NAMES:
        np.testing.assert_array_equal(getattr(layer, name).numpy(), rec[f"init/{name}"])
    np.testing.assert_array_equal(layer.w0().numpy(), rec["init/dequantized"])
    for prev, now, k in _steps(rec):
        with torch.no_grad():
            for name in NAMES:
                getattr(layer, name).copy_(torch.as_tensor(rec[f"{prev}/{name}"]))
            layer.set_permutations(rec[f"{prev}/perm_in"], rec[f"{prev}/perm_out"])
            layer.oft_R.copy_(torch.as_tensor(rec[f"{now}/oft_R"]))
        want = rec[f"{now}/effective_weight"]
        got = layer.effective_weight().numpy()
        assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max(), k
        layer.merge_and_reset(perm_in=rec[f"{now}/perm_in"], perm_out=rec[f"{now}/perm_out"])
        for name in NAMES:
            np.testing.assert_array_equal(getattr(layer, name).numpy(), rec[f"{now}/{name}"])
        deq = rec[f"{now}/dequantized"]
        assert np.abs(layer.w0().numpy() - deq).max() <= 1e-6 * np.abs(deq).max()


@needs_jax
@needs_torch
def test_jax_merge_replays_the_authors_merges(rec):
    import jax.numpy as jnp

    from xopt.jax.poet import merge_layer

    codes = P.quantize_weight(jnp.asarray(_normalised(rec)), GS)
    for name, got in zip(NAMES, codes, strict=True):
        np.testing.assert_array_equal(np.asarray(got), rec[f"init/{name}"])
    hp = P.POET(block_size=B, cayley_formula="taylor")
    for prev, now, k in _steps(rec):
        buffers = {name: jnp.asarray(rec[f"{prev}/{name}"]) for name in NAMES}
        for name in ("perm_in", "perm_out"):
            buffers[name] = jnp.asarray(rec[f"{prev}/{name}"])
            buffers[name + "_inv"] = jnp.asarray(P.inverse(rec[f"{prev}/{name}"]), jnp.int32)
        buffers["merges"] = jnp.asarray(k, jnp.int32)
        _, out = merge_layer({"oft_R": jnp.asarray(rec[f"{now}/oft_R"])}, buffers, hp,
                             rec[f"{now}/perm_in"], rec[f"{now}/perm_out"])
        # codes and zero points byte-exact; the scales are (max − min)/255 of the merged
        # float32 W0, whose XLA products round apart from torch's by an ulp here and there:
        # a scale may sit one ulp off, and the dequantised W0 with it
        np.testing.assert_array_equal(np.asarray(out["weight"]), rec[f"{now}/weight"])
        np.testing.assert_array_equal(np.asarray(out["weight_zeros"]),
                                      rec[f"{now}/weight_zeros"])
        for got, want in ((out["weight_scales"], rec[f"{now}/weight_scales"]),
                          (P.dequantize_weight(out["weight"], out["weight_scales"],
                                               out["weight_zeros"], GS),
                           rec[f"{now}/dequantized"])):
            got = np.asarray(got)
            assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max(), k


def test_float64_oracle_of_the_merges(rec):
    """The spec's equations in float64 against the recording: the merged W_eff to float32
    rounding, and the recorded codes holding the float64 merge to half a step."""
    for prev, now, k in _steps(rec):
        w0 = P.dequantize_weight(rec[f"{prev}/weight"],
                                 rec[f"{prev}/weight_scales"].astype(np.float64),
                                 rec[f"{prev}/weight_zeros"].astype(np.float64), GS)
        ro, ri = P.rotations(rec[f"{now}/oft_R"].astype(np.float64), B, 48 // B,
                             formula="taylor")
        pin, pout = rec[f"{prev}/perm_in"].astype(np.int64), rec[f"{prev}/perm_out"].astype(
            np.int64)
        w_eff = P.effective_weight(w0, ro, ri, pin, pout)
        want = rec[f"{now}/effective_weight"]
        assert np.abs(w_eff - want).max() <= 1e-6 * np.abs(want).max(), k
        new = P.merged_weight(w0, ro, ri, pin, pout, P.inverse(rec[f"{now}/perm_in"]),
                              P.inverse(rec[f"{now}/perm_out"]))
        step = np.repeat(rec[f"{now}/weight_scales"].astype(np.float64), GS, axis=1)
        err = np.abs(rec[f"{now}/dequantized"] - new).reshape(-1, GS)
        assert np.all(err <= step * 0.5 + 1e-6 * np.abs(new).max()), k


LAYER = CASE.with_name("xq_layer_in64_out48_b16_g256")


@pytest.fixture(scope="module")
def layer_rec():
    manifest = json.loads(LAYER.with_suffix(".json").read_text())
    assert manifest["source"]["commit"].startswith("3a34bb6")
    with np.load(LAYER.with_suffix(".npz")) as z:
        return {k: z[k] for k in z.files}


def _close(got, want, what):
    got = np.asarray(got)
    assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max(), what


@needs_torch
@pytest.mark.parametrize("impl", ["plain", "triton"])
@pytest.mark.parametrize("variant", ["fast", "mem"])
def test_torch_layer_replays_the_authors_forward(layer_rec, variant, impl):
    """One teacher-forced step of QPOETLinear (the Triton Cayley kernel's "product"
    series): output and both gradients within 1e-6."""
    from xopt.torch.poet import POETLinear

    if impl == "triton" and not (torch.cuda.is_available()
                                 or os.environ.get("TRITON_INTERPRET") == "1"):
        pytest.skip("the triton path needs a GPU, or TRITON_INTERPRET=1 on the CPU")
    r = {k.split("/", 1)[1]: v for k, v in layer_rec.items() if k.startswith(variant + "/")}
    layer = POETLinear(64, 48, B, variant=variant, weight_bits=8, weight_group_size=GS,
                       impl=impl)
    with torch.no_grad():
        for name in (*NAMES, "oft_R"):
            getattr(layer, name).copy_(torch.as_tensor(r[name]))
        layer.set_permutations(r["perm_in"], r["perm_out"])
    x = torch.as_tensor(r["x"]).requires_grad_(True)
    y = layer(x)
    y.backward(torch.as_tensor(r["grad_output"]))
    _close(y.detach(), r["y"], "y")
    _close(x.grad, r["grad_input"], "grad_input")
    _close(layer.oft_R.grad, r["grad/oft_R"], "grad/oft_R")


@needs_jax
@pytest.mark.parametrize("variant", ["fast", "mem"])
def test_jax_layer_replays_the_authors_forward(layer_rec, variant):
    import jax
    import jax.numpy as jnp

    from xopt.jax.poet import POETDense

    r = {k.split("/", 1)[1]: v for k, v in layer_rec.items() if k.startswith(variant + "/")}
    dense = POETDense(48, block_size=B, variant=variant, weight_bits=8, weight_group_size=GS)
    poet = dict(dense.init(jax.random.PRNGKey(0), jnp.zeros((1, 64)))["poet"])
    for name in NAMES:
        poet[name] = jnp.asarray(r[name])
    for name in ("perm_in", "perm_out"):
        poet[name] = jnp.asarray(r[name])
        poet[name + "_inv"] = jnp.asarray(P.inverse(r[name]), jnp.int32)

    def f(oft, x):
        return dense.apply({"params": {"oft_R": oft}, "poet": poet}, x)

    y, vjp = jax.vjp(f, jnp.asarray(r["oft_R"]), jnp.asarray(r["x"]))
    g_oft, g_x = vjp(jnp.asarray(r["grad_output"]))
    _close(y, r["y"], "y")
    _close(g_x, r["grad_input"], "grad_input")
    _close(g_oft, r["grad/oft_R"], "grad/oft_R")
