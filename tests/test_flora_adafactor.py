"""Flora's fused Adafactor passes (xopt.kernels.adafactor) under TRITON_INTERPRET=1 at
small sizes: the stacked step with them agrees with the torch path (and so with the
per-parameter step) to float32 rounding; only the sums' order differs."""

from __future__ import annotations

import pytest
from helpers import has_torch, triton_kernel_target

pytestmark = pytest.mark.skipif(not has_torch, reason="needs torch")

if has_torch:
    import torch

needs_kernel, DEVICE = triton_kernel_target()

#: a tile's rows and columns cut short (40 = 32 + 8 rows, 130 = 128 + 2 columns), and
#: a matrix of fewer rows than a tile
SHAPES = [(40, 130), (40, 130), (5, 33), (7,)]


def _run(backend, monkeypatch, dtype, **kw):
    import xopt.torch as xt
    from xopt.kernels import adafactor

    monkeypatch.setattr(adafactor, "BACKEND", backend)
    gen = torch.Generator().manual_seed(2)
    ps = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype).to(DEVICE))
          for s in SHAPES]
    opt = xt.Flora(ps, **kw)
    for _ in range(3):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen).to(dtype).to(DEVICE)
        opt.step()
    return ps, opt


@needs_kernel
@pytest.mark.parametrize("kw", [dict(lr=1e-2), dict(lr=1e-2, scale_parameter=False),
                                dict(relative_step=True, clip_threshold=0.5)],
                         ids=["scaled", "unscaled", "relative-clipped"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_passes_are_the_torch_paths_step(kw, dtype, monkeypatch):
    """Three updates (the first allocates and runs per parameter, the next two stacked):
    parameters, row and column statistics and RMS within float32 rounding of the torch
    path's (clip_threshold 0.5 makes the clip divide)."""
    dtype = getattr(torch, dtype)
    pa, oa = _run("triton", monkeypatch, dtype, **kw)
    pb, ob = _run("torch", monkeypatch, dtype, **kw)
    for p, q in zip(pa, pb, strict=True):
        sa, sb = oa.state[p], ob.state[q]
        assert list(sa) == list(sb) and sa["step"] == sb["step"] == 3
        for k in ("exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq", "RMS"):
            if k in sa:
                assert sa[k].dtype == sb[k].dtype and sa[k].shape == sb[k].shape
                torch.testing.assert_close(sa[k], sb[k], rtol=1e-6, atol=0)
        a, b = p.detach().double(), q.detach().double()
        assert float((a - b).norm() / b.norm()) <= 1e-6


@needs_kernel
def test_stats_are_the_sums():
    """The first pass's sums against torch's (float64 reference, float32 tolerance)."""
    from xopt.kernels import adafactor

    gen = torch.Generator().manual_seed(3)
    x = torch.randn((2, 40, 130), generator=gen).to(DEVICE)
    g = torch.randn((2, 40, 130), generator=gen).to(DEVICE)
    rows, cols, x_sq = adafactor.stats(x, g, 1e-30)
    a = g.double() ** 2 + 1e-30
    torch.testing.assert_close(rows.double(), a.sum(-1), rtol=1e-5, atol=0)
    torch.testing.assert_close(cols.double(), a.sum(-2), rtol=1e-5, atol=0)
    torch.testing.assert_close(x_sq.double(), (x.double() ** 2).sum((-2, -1)), rtol=1e-5,
                               atol=0)
    with pytest.raises(ValueError, match="g must be"):
        adafactor.stats(x, g.double(), 1e-30)
