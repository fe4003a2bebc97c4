"""The prototype kernels against PyTorch references at small sizes, on the CPU:

TRITON_INTERPRET=1 PYTHONPATH=$PWD python3 bench/poet_probe/check_interpreter.py
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import rot_kernels as rotk  # noqa: E402

torch.manual_seed(0)
T, nb, b = 64, 2, 32
x = torch.randn(T, nb * b)
r = torch.randn(nb, b, b)
gi = torch.randperm(nb * b).to(torch.int32)
si = torch.randperm(nb * b).to(torch.int32)


def ref(x, r, gi=None, si=None, trans=False):
    x1 = x[:, gi.long()] if gi is not None else x
    rr = r.transpose(1, 2) if trans else r
    z = torch.einsum("tjk,jkc->tjc", x1.view(T, nb, b), rr).reshape(T, nb * b)
    if si is not None:
        out = torch.empty_like(z)
        out[:, si.long()] = z
        return out
    return z


for g in (None, gi):
    for s in (None, si):
        for tr in (False, True):
            o = rotk.rot(x, r, g, s, tr, bm=16, bn=16, bk=16, warps=1)
            e = ref(x, r, g, s, tr)
            print(g is not None, s is not None, tr, (o - e).abs().max().item())
a = torch.randn(T, nb * b)
gg = torch.randn(T, nb * b)
o = rotk.outer(a, gg, nb, split=2, bm=16, bn=16, bk=16, warps=1)
e = torch.einsum("tjr,tjc->jrc", a.view(T, nb, b), gg.view(T, nb, b))
print("outer", (o - e).abs().max().item())
import skew_gather_kernels as kern2  # noqa: E402

from xopt.kernels import poet_cayley as K  # noqa: E402

for b in (16, 48):
    x = torch.randn(3, b * (b - 1) // 2)
    q, i = kern2.skew_rows(x, b, 4, 16, 1)
    print(
        "skew",
        b,
        (q - K.skew_reference(x, b)).abs().max().item(),
        (i - torch.eye(b)).abs().max().item(),
    )
x = torch.randn(37, 64)
p = torch.randperm(64).to(torch.int32)
print("gather", (kern2.gather_persist(x, p, 5, 2, 1) - x[:, p.long()]).abs().max().item())
