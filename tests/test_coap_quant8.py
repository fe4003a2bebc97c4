"""8-bit COAP's fused moment step (xopt.kernels.quant8) under TRITON_INTERPRET=1 at small
sizes: the codes and absmax are the torch path's bytes (the per-tensor quantize of the
spec), the directions IEEE float32's."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import has_torch, triton_kernel_target

pytestmark = pytest.mark.skipif(not has_torch, reason="needs torch")

if has_torch:
    import torch

needs_kernel, DEVICE = triton_kernel_target()

B1, B2, EPS = 0.9, 0.999, 1e-8


def _moments(shape, rounding, gen):
    """Three quantised moment pairs of ``shape`` (a block of zeros, a NaN and an inf among
    them) and gradients, as the state holds them, stacked."""
    from xopt.specs import coap as C

    m = torch.randn((3, *shape), generator=gen) * 1e-3
    v = torch.rand((3, *shape), generator=gen) * 1e-6
    r = torch.randn((3, *shape), generator=gen) * 1e-2
    m[1].view(-1)[:4096] = 0.0  # m and v of a whole block zero, r too: absmax 0, codes 0
    v[1].view(-1)[:4096] = 0.0
    r[1].view(-1)[:4096] = 0.0
    if rounding == "cuda":  # (bitsandbytes' CPU table has no code for NaN)
        r[2].view(-1)[5] = float("nan")  # its block: absmax NaN, codes 0
        r[2].view(-1)[-3] = float("inf")  # its block: absmax inf, the others' codes of 0
    q = [[C.quantize(torch, x[j], rounding) for j in range(3)] for x in (m, v)]
    out = ([torch.stack([c.reshape(-1) for c, _ in qs]) for qs in q]
           + [torch.stack([a for _, a in qs]) for qs in q] + [r])
    return [x.to(DEVICE) for x in out]


def _torch_path(mq, vq, ma, va, r, rounding):
    """The torch ops of LowRankOptimizer._hf_adam_run with COAP's 8-bit moments, per tensor."""
    from xopt.specs import coap as C

    out = []
    mq, vq, ma, va, r = (x.cpu() for x in (mq, vq, ma, va, r))
    for j in range(r.shape[0]):
        m = C.dequantize(torch, mq[j].view(r.shape[1:]), ma[j])
        v = C.dequantize(torch, vq[j].view(r.shape[1:]), va[j])
        m = m * B1 + r[j] * (1.0 - B1)
        v = v * B2 + (r[j] * r[j]) * (1.0 - B2)
        # the direction in IEEE float32 (numpy: correctly rounded sqrt and division;
        # torch's CPU sqrt is not, in the last bit; on CUDA it is)
        mn, vn = m.numpy(), v.numpy()
        with np.errstate(invalid="ignore"):
            n = mn / (np.sqrt(vn) + np.float32(EPS))
        out.append((torch.from_numpy(n), *C.quantize(torch, m, rounding),
                    *C.quantize(torch, v, rounding)))
    return [torch.stack(x) for x in zip(*out, strict=True)]


def _same(a, b):
    """Bit for bit, except that a NaN matches any NaN: payloads are not specified (a GPU's
    quiet NaN is 0x7fffffff, NumPy's 0xffc00000 or the operand's)."""
    if a.is_floating_point():
        nan = a.isnan()
        return (a.shape == b.shape and torch.equal(nan, b.isnan())
                and torch.equal(a.view(torch.int32)[~nan], b.view(torch.int32)[~nan]))
    return torch.equal(a, b)


@needs_kernel
@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the NaN and inf entries
@pytest.mark.parametrize("rounding", ["cuda", "cpu"])
def test_fused_step_gives_the_torch_paths_bytes(rounding):
    """Three matrices of 5 x 1000 (a whole block and a short one each), one launch: codes
    and absmax byte for byte the spec's quantize of the torch path's updated moments, the
    directions IEEE float32's ``m / (√v + ε)``."""
    from xopt.kernels import quant8

    gen = torch.Generator().manual_seed(0)
    shape = (5, 1000)
    mq, vq, ma, va, r = _moments(shape, rounding, gen)
    want = _torch_path(mq, vq, ma, va, r, rounding)
    n = quant8.adam_step(mq, ma, vq, va, r, B1, B2, EPS, rounding)
    got = [x.cpu() for x in (n, mq.view(3, *shape), ma, vq.view(3, *shape), va)]
    mq, vq, ma, va = got[1].view(3, -1), got[3].view(3, -1), got[2], got[4]
    for name, a, b in zip(("n", "m codes", "m absmax", "v codes", "v absmax"), got, want,
                          strict=True):
        assert _same(a, b), name
    assert bool((ma[1, 0] == 0) & (mq[1, :4096] == 0).all())
    if rounding == "cuda":
        assert bool(va[2, 0].isnan()) and bool((vq[2, :4096] == 0).all())
        assert bool(va[2, 1].isinf())


def _coap_run(backend, monkeypatch, rounding):
    import xopt.torch as xt
    from xopt.kernels import quant8

    monkeypatch.setattr(quant8, "BACKEND", backend)
    gen = torch.Generator().manual_seed(1)
    shapes = [(12, 8), (12, 8), (8, 12), (7,)]
    ps = [torch.nn.Parameter(torch.randn(s, generator=gen).to(DEVICE)) for s in shapes]
    opt = xt.COAP([{"params": ps[:3]}, {"params": ps[3:], "project": False}], lr=0.01,
                  rank=3, update_interval=2, reproject_factor=2, state_bits=8,
                  quant_rounding=rounding)
    for _ in range(3):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen).to(DEVICE)
        opt.step()
    return ps, opt


@needs_kernel
@pytest.mark.parametrize("rounding", ["cuda", "cpu"])
def test_coap_8bit_steps_with_the_kernel_keep_the_torch_paths_bytes(rounding, monkeypatch):
    """Three COAP updates (Eqn 7, an ordinary step, Eqn 6; projected matrices of two
    shapes and a vector) with the fused kernel and with the torch ops: the same codes and
    absmax at the end (the moments and projections depend on the gradients only), the
    parameters within float32 rounding (the torch path's CPU square root is a last-bit
    off now and then)."""
    pa, oa = _coap_run("triton", monkeypatch, rounding)
    pb, ob = _coap_run("torch", monkeypatch, rounding)
    for p, q in zip(pa, pb, strict=True):
        sa, sb = oa.state[p], ob.state[q]
        assert list(sa) == list(sb)
        for k in ("exp_avg_codes", "exp_avg_absmax", "exp_avg_sq_codes", "exp_avg_sq_absmax",
                  "ortho_matrix"):
            if k in sa:
                assert _same(sa[k], sb[k]), k
        a, b = p.detach().double(), q.detach().double()
        assert float((a - b).norm() / b.norm()) <= 1e-6


@needs_kernel
def test_bad_buffers_are_named():
    from xopt.kernels import quant8

    q = torch.zeros(2, 10, dtype=torch.uint8, device=DEVICE)
    a = torch.zeros(2, 1, device=DEVICE)
    with pytest.raises(ValueError, match="v_absmax"):
        quant8.adam_step(q, a, q.clone(), torch.zeros(2, 2, device=DEVICE),
                         torch.zeros(2, 10, device=DEVICE), B1, B2, EPS, "cuda")
    with pytest.raises(ValueError, match="rounding"):
        quant8.adam_step(q, a, q.clone(), a.clone(), torch.zeros(2, 10, device=DEVICE), B1,
                         B2, EPS, "gpu")


def test_table_encode_is_the_specs_search_everywhere():
    """The torch path's code lookup (xopt.torch.coap's table over the thresholds) against
    the spec's binary search: at every code and every float32 midpoint of two codes, at
    their float32 neighbours on both sides (between two thresholds the search's
    comparisons, hence its code, cannot change), at random values in and beyond [-1, 1],
    random bit patterns, ±0, ±inf and NaN."""
    from xopt.specs import coap as C
    from xopt.torch import coap as tc

    code = C.dynamic_code()
    mids = ((code[:, None] + code[None, :]) * np.float32(0.5)).astype(np.float32).reshape(-1)
    pts = np.unique(np.concatenate([code, mids]))
    rng = np.random.default_rng(0)
    y = np.concatenate([
        pts, np.nextafter(pts, np.float32(np.inf)), np.nextafter(pts, np.float32(-np.inf)),
        rng.uniform(-1.1, 1.1, 100_000).astype(np.float32),
        (rng.standard_normal(20_000) * 10.0 ** rng.integers(-9, 1, 20_000)).astype(np.float32),
        rng.integers(0, 2**32, 20_000, dtype=np.uint64).astype(np.uint32).view(np.float32),
        np.float32([0.0, -0.0, np.inf, -np.inf, np.nan])])
    y = torch.from_numpy(y)
    assert torch.equal(tc._encode(y, "cuda"), C.encode(torch, y, "cuda"))
