"""The fast layer's backward in four orders of its gradient products (A: the committed one),
the outer product with swapped operands, and the gather's warps (H100, 4096², b = 256/512).

    PYTHONPATH=$PWD python3 bench/poet_probe/backward_order.py
"""

import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from graph_time import fwd_bwd, gtime  # noqa: E402

import xopt.torch.poet as P  # noqa: E402
from xopt.kernels import poet_cayley  # noqa: E402

ORDER = "A"


def backward(ctx, g):
    _rotate, _outer, _gather = P._rotate, P._outer, P._gather
    xs, r, weight, bias, perm_in, perm_in_inv, perm_out_inv, y1, *cnp_saved = ctx.saved_tensors
    keep_y1, triton_path, shape, n_out = ctx.flags
    r_out, r_in = r[:n_out], r[n_out:]
    g2d = g.reshape(-1, g.shape[-1])
    x1 = xs
    g2 = _gather(g2d, perm_out_inv, triton_path)
    grad_r = torch.empty_like(r)
    if ORDER in ("A", "D"):
        _outer(y1, g2, n_out, out=grad_r[:n_out])
        gy1 = _rotate(g2, r_out, transpose=True)
    else:
        gy1 = _rotate(g2, r_out, transpose=True)
        _outer(y1, g2, n_out, out=grad_r[:n_out])
    del y1, g2
    gx2 = torch.mm(gy1, weight)
    del gy1
    if ORDER in ("A", "C"):
        _outer(x1, gx2, r.shape[0] - n_out, out=grad_r[n_out:])
        gx1 = _rotate(gx2, r_in, transpose=True)
    else:
        gx1 = _rotate(gx2, r_in, transpose=True)
        _outer(x1, gx2, r.shape[0] - n_out, out=grad_r[n_out:])
    gx = _gather(gx1, perm_in, triton_path).reshape(shape)
    b, formula, tf32, backend, oft_dtype = ctx.cnp
    grad_r = poet_cayley.blocks_backward(
        tuple(cnp_saved), grad_r, b, formula, tf32, backend, oft_dtype
    )
    return (gx, grad_r, None, None, None, None, None, None, None, None, None, None)


orig = P._Chain.backward
dev = torch.device("cuda")
dt = torch.bfloat16
T = 4096
x = torch.randn(T, 4096, device=dev, dtype=dt, requires_grad=True)
gy = torch.randn(T, 4096, device=dev, dtype=dt)


def fb(layer):
    return fwd_bwd(layer, x, gy)


lin = nn.Linear(4096, 4096, bias=False, device=dev, dtype=dt)
tl_ = gtime(fb(lin), 10)
print(f"nn.Linear {tl_:.1f} us", flush=True)
for b in (256, 512):
    layer = P.POETLinear(4096, 4096, b, variant="fast", impl="triton", device=dev, dtype=dt)
    with torch.no_grad():
        layer.oft_R.normal_(0, 0.01)
    for _rep in range(2):
        P._Chain.backward = orig
        us = gtime(fb(layer), 10)
        print(f"  b={b} committed: {us:.1f} us ({us / tl_:.3f}x)", flush=True)
        P._Chain.backward = staticmethod(backward)
        for o in "ABCD":
            ORDER = o
            us = gtime(fb(layer), 10)
            print(f"  b={b} order {o}: {us:.1f} us ({us / tl_:.3f}x)", flush=True)
    P._Chain.backward = orig
    # outer orientation micro
    nb = 4096 // b
    y1 = torch.randn(T, 4096, device=dev, dtype=dt)
    g2 = torch.randn(T, 4096, device=dev, dtype=dt)
    out = torch.empty(nb, b, b, device=dev, dtype=dt)
    a1 = gtime(lambda: P._outer(y1, g2, nb, out=out))
    gv, yv = g2.view(T, nb, b).permute(1, 2, 0), y1.view(T, nb, b).transpose(0, 1)
    a2 = gtime(lambda: torch.bmm(gv, yv, out=out))
    print(f"  b={b} outer y1^T g2: {a1:.1f} us, swapped g2^T y1: {a2:.1f} us", flush=True)
    # gather warps
    from xopt.kernels import poet_perm as PP

    p = torch.randperm(4096, device=dev).to(torch.int32)
    for w in (4, 8):
        PP.ROWLOOP["warps"] = w
        print(f"  gather warps={w}: {gtime(lambda: PP.gather(y1, p)):.1f} us", flush=True)
    PP.ROWLOOP["warps"] = 8
    del layer
