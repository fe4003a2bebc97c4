"""Sweeps behind two fifth-session defaults (H100): the skew blocks with the identity as
square tiles (the old kernel, tile edge × warps) against whole rows (rows × column chunk ×
warps), and gathers of a (4096, 4096) bf16 activation (rowloop settings; a persistent
variant).

    PYTHONPATH=$PWD python3 bench/poet_probe/skew_gather.py
"""

import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import skew_gather_kernels as kern2  # noqa: E402
from graph_time import gtime  # noqa: E402

from xopt.kernels import poet_cayley as K  # noqa: E402
from xopt.kernels import poet_perm as PP  # noqa: E402

dev = torch.device("cuda")
dt = torch.bfloat16
res = {}
for b, nblk in ((256, 32), (512, 16)):
    m = b * (b - 1) // 2
    x = (0.01 * torch.randn(nblk, m, device=dev)).to(dt)
    qr = K.skew_reference(x.float(), b)
    q0 = torch.empty(nblk, b, b, device=dev, dtype=dt)
    i0 = torch.empty_like(q0)
    res[f"b{b}_zeros2"] = gtime(
        lambda: (
            torch.zeros(nblk, b, b, device=dev, dtype=dt),
            torch.zeros(nblk, b, b, device=dev, dtype=dt),
        )
    )
    res[f"b{b}_cur"] = gtime(
        lambda: kern2.skew_tiles_kernel[(nblk, 4 if b == 256 else 8, 4 if b == 256 else 8)](
            x, q0, i0, b, m, EYE=True, T=64
        )
    )
    print(
        f"b={b}: two zeros {res[f'b{b}_zeros2']:.1f} us, "
        f"square-tile skew+eye {res[f'b{b}_cur']:.1f} us",
        flush=True,
    )
    for t in (16, 32, 64):
        for w in (1, 2, 4, 8):
            q = torch.empty(nblk, b, b, device=dev, dtype=dt)
            i = torch.empty_like(q)

            def f():
                return kern2.skew_tiles_kernel[(nblk, triton.cdiv(b, t), triton.cdiv(b, t))](
                    x, q, i, b, m, EYE=True, T=t, num_warps=w
                )

            f()
            err = (q.float() - qr).abs().max().item()
            us = gtime(f)
            res[f"b{b}_cur_T{t}_w{w}"] = us
            print(f"  current kernel T={t} warps={w}: {us:.1f} us (err {err:.1e})", flush=True)
    for rows in (1, 2, 4, 8):
        for bc in (128, 256, 512):
            if bc > b:
                continue
            for w in (2, 4, 8):
                try:
                    q, i = kern2.skew_rows(x, b, rows, bc, w)
                    err = (q.float() - qr).abs().max().item()
                    us = gtime(lambda: kern2.skew_rows(x, b, rows, bc, w))
                except Exception as e:
                    print("  rows fail", rows, bc, w, str(e)[:150])
                    continue
                res[f"b{b}_rows{rows}_bc{bc}_w{w}"] = us
                print(
                    f"  row kernel rows={rows} bc={bc} warps={w}: {us:.1f} us (err {err:.1e})",
                    flush=True,
                )
for d in (4096, 14336):
    xg = torch.randn(4096, d, device=dev, dtype=dt)
    p = torch.randperm(d, device=dev).to(torch.int32)
    ref = xg[:, p.long()]
    res[f"d{d}_copy"] = gtime(lambda: xg.clone())
    res[f"d{d}_rowloop"] = gtime(lambda: PP.gather(xg, p))
    print(f"d={d}: copy {res[f'd{d}_copy']:.1f}, rowloop {res[f'd{d}_rowloop']:.1f}", flush=True)
    if d == 4096:
        for w in (4, 8, 16):
            for grid in (132, 264, 528, 1056):
                for rows in (1, 2):
                    try:
                        o = kern2.gather_persist(xg, p, grid, rows, w)
                        ok = torch.equal(o, ref)
                        us = gtime(lambda: kern2.gather_persist(xg, p, grid, rows, w))
                    except Exception as e:
                        print("  persist fail", w, grid, rows, str(e)[:150])
                        continue
                    res[f"d{d}_persist_w{w}_g{grid}_r{rows}"] = us
                    print(
                        f"  persistent warps={w} grid={grid} rows={rows}: {us:.1f} us (exact {ok})",
                        flush=True,
                    )
        for rows in (1, 2, 4):
            for bd in (1024, 2048, 4096):
                for w in (4, 8):
                    PP.ROWLOOP.update(rows=rows, block_d=bd, warps=w)
                    us = gtime(lambda: PP.gather(xg, p))
                    res[f"d{d}_rowloop_r{rows}_bd{bd}_w{w}"] = us
                    print(f"  rowloop rows={rows} block_d={bd} warps={w}: {us:.1f}", flush=True)
        PP.ROWLOOP.update(rows=None, block_d=None, warps=8)
out = os.environ.get("OUT")
if out:
    json.dump(res, open(os.path.join(out, "probe2.json"), "w"), indent=1)
