"""Where the fast layer's fwd+bwd time goes at 4096² (graph replays, per-kernel profile), and
whether Triton block rotations with fused gathers/scatters, split-K outer products or token
chunks (for L2 reuse) beat a gather + cuBLAS bmm (H100, bf16, 4096 tokens).

    PYTHONPATH=$PWD python3 bench/poet_probe/rotations.py [layer] [rot]
"""

import json
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import rot_kernels as rotk  # noqa: E402
from graph_time import fwd_bwd, gtime  # noqa: E402

from xopt.kernels import poet_perm as PP  # noqa: E402
from xopt.torch.poet import POETLinear, _outer, _rotate  # noqa: E402

dev = torch.device("cuda")
dt = torch.bfloat16
T, n = 4096, 4096
res = {}


def layer_part():
    x = torch.randn(T, n, device=dev, dtype=dt, requires_grad=True)
    gy = torch.randn(T, n, device=dev, dtype=dt)
    lin = nn.Linear(n, n, bias=False, device=dev, dtype=dt)

    def fb(layer):
        return fwd_bwd(layer, x, gy)

    res["linear_us"] = gtime(fb(lin), 10)
    print("nn.Linear fwd+bwd", res["linear_us"], flush=True)
    for b in (256, 512):
        layer = POETLinear(n, n, b, variant="fast", impl="triton", device=dev, dtype=dt)
        with torch.no_grad():
            layer.oft_R.normal_(0, 0.01)
        us = gtime(fb(layer), 10)
        res[f"poet_b{b}_us"] = us
        print(f"xopt fast b={b}: {us:.1f} us ({us / res['linear_us']:.3f}x)", flush=True)
        from torch.profiler import ProfilerActivity, profile

        f = fb(layer)
        f()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            for _ in range(5):
                f()
            torch.cuda.synchronize()
        rows = {}
        for e in p.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                k = e.name[:90]
                c, t = rows.get(k, (0, 0.0))
                rows[k] = (c + 1, t + e.device_time)
        tot = sum(t for _, t in rows.values()) / 5
        print(f"-- kernels b={b}: sum {tot:.1f} us per fwd+bwd")
        for k, (c, t) in sorted(rows.items(), key=lambda kv: -kv[1][1]):
            print(f"  {t / 5:8.1f} us  x{c / 5:.0f}  {k}")
        del layer


def rot_part():
    x = torch.randn(T, n, device=dev, dtype=dt)
    perm = torch.randperm(n, device=dev).to(torch.int32)
    perm2 = torch.randperm(n, device=dev).to(torch.int32)
    res["copy_us"] = gtime(lambda: x.clone())
    res["gather_us"] = gtime(lambda: PP.gather(x, perm))
    print(f"copy {res['copy_us']:.1f} us, rowloop gather {res['gather_us']:.1f} us", flush=True)
    for b in (256, 512):
        nb = n // b
        r = (torch.randn(nb, b, b, device=dev, dtype=torch.float32) / b**0.5).to(dt)
        # references
        x1 = PP.gather(x, perm)
        ref = _rotate(x1, r)
        res[f"b{b}_cublas_rot_us"] = gtime(lambda: _rotate(x1, r))
        res[f"b{b}_cublas_rotT_us"] = gtime(lambda: _rotate(x1, r, transpose=True))
        res[f"b{b}_gather+cublas_us"] = gtime(lambda: _rotate(PP.gather(x, perm), r))
        res[f"b{b}_cublas+gather_us"] = gtime(lambda: PP.gather(_rotate(x, r), perm2))
        print(
            f"b={b}: cublas rot {res[f'b{b}_cublas_rot_us']:.1f} "
            f"(T {res[f'b{b}_cublas_rotT_us']:.1f}), "
            f"gather+rot {res[f'b{b}_gather+cublas_us']:.1f}, "
            f"rot+gather {res[f'b{b}_cublas+gather_us']:.1f}",
            flush=True,
        )
        cfgs = (
            [
                (128, 256, 64, 8, 3),
                (128, 128, 64, 4, 3),
                (64, 256, 64, 4, 3),
                (128, 256, 32, 8, 4),
                (64, 128, 64, 4, 4),
            ]
            if b == 256
            else [
                (64, 512, 64, 8, 2),
                (128, 256, 64, 8, 3),
                (64, 256, 64, 4, 3),
                (128, 128, 64, 4, 3),
                (64, 512, 32, 8, 3),
            ]
        )
        best = None
        for cfg in cfgs:
            bm, bn, bk, w, st = cfg
            try:
                o = rotk.rot(x1, r, bm=bm, bn=bn, bk=bk, warps=w, stages=st)
                err = (o.float() - ref.float()).abs().max().item()
                us = gtime(lambda: rotk.rot(x1, r, bm=bm, bn=bn, bk=bk, warps=w, stages=st))
            except Exception as e:
                print(
                    f"  triton plain {cfg}: failed {type(e).__name__}: {str(e)[:200]}", flush=True
                )
                continue
            res[f"b{b}_triton_plain_{cfg}"] = us
            print(f"  triton plain {cfg}: {us:.1f} us (err {err:.2e})", flush=True)
            if best is None or us < best[1]:
                best = (cfg, us)
        for cfg in [c for c in cfgs][:3]:
            bm, bn, bk, w, st = cfg
            try:
                o = rotk.rot(x, r, gidx=perm, bm=bm, bn=bn, bk=bk, warps=w, stages=st)
                err = (o.float() - ref.float()).abs().max().item()
                ug = gtime(
                    lambda: rotk.rot(x, r, gidx=perm, bm=bm, bn=bn, bk=bk, warps=w, stages=st)
                )
                z = _rotate(x, r)
                refs = PP.gather(z, perm2)
                inv2 = torch.empty_like(perm2)
                inv2[perm2.long()] = torch.arange(n, device=dev, dtype=perm2.dtype)
                o2 = rotk.rot(x, r, sidx=inv2, bm=bm, bn=bn, bk=bk, warps=w, stages=st)
                err2 = (o2.float() - refs.float()).abs().max().item()
                us2 = gtime(
                    lambda: rotk.rot(x, r, sidx=inv2, bm=bm, bn=bn, bk=bk, warps=w, stages=st)
                )
                ot = rotk.rot(x1, r, trans=True, bm=bm, bn=bn, bk=bk, warps=w, stages=st)
                errt = (ot.float() - _rotate(x1, r, transpose=True).float()).abs().max().item()
                ut = gtime(
                    lambda: rotk.rot(x1, r, trans=True, bm=bm, bn=bn, bk=bk, warps=w, stages=st)
                )
            except Exception as e:
                print(
                    f"  triton gather/scatter {cfg}: failed {type(e).__name__}: {str(e)[:200]}",
                    flush=True,
                )
                continue
            res[f"b{b}_triton_gather_{cfg}"] = ug
            res[f"b{b}_triton_scatter_{cfg}"] = us2
            res[f"b{b}_triton_trans_{cfg}"] = ut
            print(
                f"  triton {cfg}: gather-in {ug:.1f} us (err {err:.2e}), scatter-out {us2:.1f} us "
                f"(err {err2:.2e}), transposed R {ut:.1f} (err {errt:.2e})",
                flush=True,
            )
        # outer products
        g = torch.randn(T, n, device=dev, dtype=dt)
        oref = _outer(x1, g, nb)
        res[f"b{b}_cublas_outer_us"] = gtime(lambda: _outer(x1, g, nb))
        print(f"  cublas outer {res[f'b{b}_cublas_outer_us']:.1f} us", flush=True)
        for split in (1, 2, 4):
            for cfg in ((128, 128, 64, 8, 3), (128, 128, 64, 4, 4)):
                bm, bn, bk, w, st = cfg
                try:
                    o = rotk.outer(x1, g, nb, split, bm, bn, bk, w, st)
                    err = ((o - oref.float()).abs().max() / oref.float().abs().max()).item()
                    us = gtime(lambda: rotk.outer(x1, g, nb, split, bm, bn, bk, w, st))
                except Exception as e:
                    print(f"  triton outer split {split} {cfg}: failed {str(e)[:200]}", flush=True)
                    continue
                res[f"b{b}_triton_outer_s{split}_{cfg}"] = us
                print(
                    f"  triton outer split {split} {cfg}: {us:.1f} us "
                    f"(rel err vs cublas bf16 {err:.2e})",
                    flush=True,
                )
        # L2 chunking: gather then rotate, chunk by chunk
        for chunks in (1, 2, 4, 8):
            x1c = torch.empty_like(x)
            outc = torch.empty_like(x)
            step = T // chunks

            def f():
                for c in range(chunks):
                    sl = slice(c * step, (c + 1) * step)
                    PP._rowloop_launch(x[sl], perm, x1c[sl])
                    xv = x1c[sl].view(step, nb, b).transpose(0, 1)
                    torch.bmm(xv, r, out=outc[sl].view(step, nb, b).transpose(0, 1))

            f()
            assert torch.equal(outc, ref) or (outc.float() - ref.float()).abs().max().item() < 1e-2
            us = gtime(f)
            res[f"b{b}_chunked{chunks}_gather+rot_us"] = us
            print(f"  chunks {chunks}: gather+rot {us:.1f} us", flush=True)


which = sys.argv[1:] or ["layer", "rot"]
print(torch.cuda.get_device_name(), torch.__version__, flush=True)
if "layer" in which:
    layer_part()
if "rot" in which:
    rot_part()
out = os.environ.get("OUT")
if out:
    with open(os.path.join(out, "probe.json"), "w") as fh:
        json.dump({k: v for k, v in res.items()}, fh, indent=1)
