"""The low-rank optimizers' one-pass AdamW moments (xopt.kernels.lowrank_adam) under
TRITON_INTERPRET=1 at small sizes (compiled on a GPU): the moments are the foreach path's
bits, the directions IEEE float32's, and GaLore, COAP and PLUMAGE step to the same bits
with the kernel as with the foreach ops."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import REPO, has_torch, triton_kernel_target

pytestmark = pytest.mark.skipif(not has_torch, reason="needs torch")

if has_torch:
    import torch

needs_kernel, DEVICE = triton_kernel_target()

B1, B2, EPS = 0.9, 0.999, 1e-8


def _same(a, b):
    """Bit for bit; a NaN matches any NaN (payloads are not specified)."""
    a, b = a.cpu(), b.cpu()
    nan = a.isnan()
    return (a.shape == b.shape and torch.equal(nan, b.isnan())
            and torch.equal(a.view(torch.int32)[~nan], b.view(torch.int32)[~nan]))


def _reference(m, v, r, eps_inside):
    """The foreach path's operations one by one in NumPy float32 (each correctly rounded,
    as CUDA's and the interpreter's are)."""
    m, v, r = (x.detach().cpu().float().numpy() for x in (m, v, r))
    f = np.float32
    m = m * f(B1) + r * f(1.0 - B1)
    v = v * f(B2) + (r * r) * f(1.0 - B2)
    with np.errstate(invalid="ignore", divide="ignore"):
        n = m / np.sqrt(v + f(EPS)) if eps_inside else m / (np.sqrt(v) + f(EPS))
    return [torch.from_numpy(x) for x in (m, v, n)]


def _moments(shapes, gen):
    m = [(torch.randn(s, generator=gen) * 1e-3).to(DEVICE) for s in shapes]
    v = [(torch.rand(s, generator=gen) * 1e-6).to(DEVICE) for s in shapes]
    return m, v


@needs_kernel
@pytest.mark.filterwarnings("ignore:invalid value encountered")
@pytest.mark.parametrize("eps_inside", [False, True], ids=["eps-outside", "eps-inside"])
@pytest.mark.parametrize("r_dtype", ["float32", "bfloat16"])
def test_a_stack_of_moments_steps_as_the_foreach_path(eps_inside, r_dtype):
    """Three (5, 37) matrices (one partial block each), the gradients stacked, a NaN and
    an inf among them: m and v in place, n stacked, every value the reference's."""
    from xopt.kernels import lowrank_adam

    gen = torch.Generator().manual_seed(0)
    m, v = _moments([(5, 37)] * 3, gen)
    r = (torch.randn(3, 5, 37, generator=gen) * 1e-2).to(getattr(torch, r_dtype))
    r[1, 2, 3], r[2, 0, 0] = float("nan"), float("inf")
    r = r.to(DEVICE)
    want = [_reference(a, b, c, eps_inside) for a, b, c in zip(m, v, r, strict=True)]
    n = lowrank_adam.adam_moments(m, v, r, B1, B2, EPS, eps_inside=eps_inside)
    assert n.shape == r.shape and n.dtype == torch.float32
    for i, (wm, wv, wn) in enumerate(want):
        assert _same(m[i], wm) and _same(v[i], wv) and _same(n[i], wn), i


@needs_kernel
def test_a_list_of_tensors_of_every_size_is_one_launch():
    """Sizes across the block boundary (1, 1023, 1024, 1025, 2500 entries), as the
    unprojected tensors arrive: a list of directions shaped like the gradients."""
    from xopt.kernels import lowrank_adam

    gen = torch.Generator().manual_seed(1)
    shapes = [(1,), (1023,), (32, 32), (5, 205), (2500,)]
    m, v = _moments(shapes, gen)
    r = [(torch.randn(s, generator=gen) * 1e-2).to(DEVICE) for s in shapes]
    want = [_reference(a, b, c, False) for a, b, c in zip(m, v, r, strict=True)]
    n = lowrank_adam.adam_moments(m, v, r, B1, B2, EPS)
    assert [tuple(x.shape) for x in n] == shapes
    for i, (wm, wv, wn) in enumerate(want):
        assert _same(m[i], wm) and _same(v[i], wv) and _same(n[i], wn), i


@needs_kernel
def test_bad_buffers_are_named_and_change_nothing():
    from xopt.kernels import lowrank_adam

    m = [torch.zeros(4, 6, device=DEVICE), torch.zeros(4, 6, device=DEVICE)]
    v = [torch.zeros(4, 6, device=DEVICE), torch.zeros(4, 6, device=DEVICE).mT]
    r = torch.ones(2, 4, 6, device=DEVICE)
    with pytest.raises(ValueError, match=r"v\[1\] must be a contiguous float32"):
        lowrank_adam.adam_moments(m, v, r, B1, B2, EPS)
    assert all(bool((x == 0).all()) for x in m)
    with pytest.raises(ValueError, match=r"m\[0\] has 24 entries, r\[0\] 12"):
        lowrank_adam.adam_moments(m[:1], m[1:], torch.ones(1, 12, device=DEVICE), B1, B2, EPS)
    with pytest.raises(ValueError, match="as many"):
        lowrank_adam.adam_moments(m, m, r[:1], B1, B2, EPS)


def _run(cls, backend, monkeypatch, dtype="float32", **kw):
    """Four steps of ``cls`` on two shapes of projected matrices and an unprojected vector
    and matrix of ``dtype``, with the moments' pass on ``backend``."""
    import xopt.torch as xt
    from xopt.kernels import lowrank_adam

    monkeypatch.setattr(lowrank_adam, "BACKEND", backend)
    if backend == "torch" and DEVICE.type == "cpu":
        # torch's CPU square root is not correctly rounded (about one value in five is a
        # last bit off); IEEE's, which CUDA's and the kernel's are, is float64's rounded
        monkeypatch.setattr(torch, "_foreach_sqrt",
                            lambda xs: [x.double().sqrt().float() for x in xs])
    gen = torch.Generator().manual_seed(2)
    shapes = [(12, 8), (12, 8), (8, 12), (7,), (6, 5)]
    ps = [torch.nn.Parameter(torch.randn(s, generator=gen).to(DEVICE, getattr(torch, dtype)))
          for s in shapes]
    opt = getattr(xt, cls)([{"params": ps[:3]}, {"params": ps[3:], "project": False}],
                           lr=0.01, rank=3, **kw)
    for _ in range(4):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen).to(DEVICE, p.dtype)
        opt.step()
    return ps, opt


@needs_kernel
@pytest.mark.parametrize("cls, kw", [
    ("GaLore", {"update_proj_gap": 2}),
    ("COAP", {"update_interval": 2, "reproject_factor": 2}),
    ("PLUMAGE", {"update_proj_gap": 2}),
    ("PLUMAGE", {"update_proj_gap": 2, "eps_inside_sqrt": True}),
    ("GaLore", {"update_proj_gap": 2, "proj_dtype": "param", "dtype": "bfloat16"}),
    ("COAP", {"update_interval": 2, "reproject_factor": 2, "proj_dtype": "param",
              "dtype": "bfloat16"}),
], ids=["galore", "coap", "plumage", "plumage-eps-inside", "galore-bf16", "coap-bf16"])
def test_optimizer_steps_with_the_kernel_are_the_foreach_paths_bits(cls, kw, monkeypatch):
    """Refreshes and ordinary steps, both products' paths (projected, stacked; unprojected,
    listed), float32 parameters and bfloat16 ones with bfloat16 products (the kernel
    widens the gradients itself): every parameter and state tensor the same bits either
    way."""
    pa, oa = _run(cls, "triton", monkeypatch, **kw)
    monkeypatch.undo()
    pb, ob = _run(cls, "torch", monkeypatch, **kw)
    for p, q in zip(pa, pb, strict=True):
        assert _same(p.detach().float(), q.detach().float())
        sa, sb = oa.state[p], ob.state[q]
        assert list(sa) == list(sb)
        for k, x in sa.items():
            if isinstance(x, torch.Tensor) and x.is_floating_point():
                assert _same(x.float(), sb[k].float()), k


@needs_kernel
def test_the_kernel_is_used_where_its_backend_says(monkeypatch):
    """With ``BACKEND = "triton"`` the step's moments go through the kernel (counted), with
    ``"torch"`` never."""
    from xopt.kernels import lowrank_adam

    calls = []
    real = lowrank_adam.adam_moments

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    for backend, want in (("triton", 2), ("torch", 0)):
        calls.clear()
        monkeypatch.setattr(lowrank_adam, "adam_moments", counted)
        import xopt.torch as xt

        monkeypatch.setattr(lowrank_adam, "BACKEND", backend)
        p = torch.nn.Parameter(torch.randn(8, 12, device=DEVICE))
        b = torch.nn.Parameter(torch.randn(12, device=DEVICE))
        opt = xt.GaLore([{"params": [p]}, {"params": [b], "project": False}], rank=3)
        p.grad, b.grad = torch.ones_like(p), torch.ones_like(b)
        opt.step()
        assert len(calls) == want, backend  # one pass projected, one unprojected


def test_an_unknown_backend_is_named(monkeypatch):
    pytest.importorskip("triton")
    from xopt.kernels import lowrank_adam

    monkeypatch.setattr(lowrank_adam, "BACKEND", "cuda")
    with pytest.raises(ValueError, match="XOPT_LOWRANK_ADAM"):
        lowrank_adam.runs_on(torch.device("cpu"))


_PTX = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from xopt.kernels import NO_FP_FUSION, lowrank_adam as la

sig = {k: "*i64" for k in ("m_tab", "v_tab", "r_tab", "n_tab", "sizes")}
sig.update({"block_tensor": "*i32", "block_index": "*i32"})
sig.update({k: "fp32" for k in ("b1", "omb1", "b2", "omb2", "eps")})
sig.update({k: "constexpr" for k in ("EPS_INSIDE", "R_BF16", "ALIGNED", "BLOCK")})
FLOAT = r"\b((?:fma|mul|add|sub|div|sqrt|rcp|rsqrt)\.[a-z0-9.]*f32)\b"
out = {}
for inside in (False, True):
    for aligned in (False, True):
        consts = {"EPS_INSIDE": inside, "R_BF16": False, "ALIGNED": aligned, "BLOCK": la._BLOCK}
        ptx = triton.compile(ASTSource(fn=la._adam_kernel, signature=sig, constexprs=consts),
                             target=GPUTarget("cuda", 90, 32),
                             options={"num_warps": la._WARPS, **NO_FP_FUSION}).asm["ptx"]
        out[f"{inside} {aligned}"] = {
            "float": sorted(set(re.findall(FLOAT, ptx))),
            "access": sorted(set(re.findall(r"\b((?:ld|st)\.global\.v4[.a-z0-9]*)", ptx)))}
print(json.dumps(out))
"""


def test_compiled_kernel_rounds_each_operation_and_vectorises_aligned_blocks(tmp_path):
    """The kernel compiled for an H100/H200 (sm_90) without a GPU, as a launch compiles it
    (NO_FP_FUSION): its float operations are round-to-nearest products and sums, the
    correctly rounded square root and division, and no fused multiply-add (the foreach
    path rounds each operation); with the addresses known 16-byte aligned, whole blocks
    are read and written 16 bytes at a time."""
    triton = pytest.importorskip("triton")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").is_file():
        pytest.skip("triton without its NVIDIA tools (ptxas)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    run = subprocess.run([sys.executable, "-c", _PTX], capture_output=True, text=True,
                         env=env, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.splitlines()[-1])
    for key, ops in got.items():
        assert ops["float"] == ["add.rn.f32", "div.rn.f32", "mul.rn.f32", "sqrt.rn.f32"], key
        aligned = key.endswith("True")
        assert bool(ops["access"]) == aligned, key
        if aligned:
            assert {"ld.global.v4.b32", "st.global.v4.b32"} <= set(ops["access"]), key
