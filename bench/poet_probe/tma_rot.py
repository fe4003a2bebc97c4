"""Prototype (twelfth session): the POET-X block rotation and outer product as persistent
Triton kernels that load through TMA descriptors, against the cuBLAS strided batched
products that ``xopt.torch.poet`` uses (``_rotate``/``_outer``). GPU µs from CUDA-graph
replays; bf16, 4096 tokens, LLaMA-8B-like widths.

    PYTHONPATH=$PWD python3 bench/poet_probe/tma_rot.py [--out FILE] [--occupancy]

Rotation: ``out[:, jB:(j+1)B] = x[:, jB:(j+1)B] · R[j]`` (or ``· R[j]ᵀ``), x ``(N, nb·B)``.
Outer: ``G[j] = x[:, jB:(j+1)B]ᵀ · g[:, jB:(j+1)B]``, ``(nb, B, B)``, optionally split
over the tokens into float32 partials that a second kernel sums in a fixed order.
"""

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from graph_time import gtime  # noqa: E402

from xopt.torch.poet import _outer, _rotate  # noqa: E402


@triton.jit
def _rot_tma(x_desc, r_desc, o_desc, N, NB, B: tl.constexpr, BM: tl.constexpr,
             BN: tl.constexpr, BK: tl.constexpr, TRANS: tl.constexpr,
             NUM_SMS: tl.constexpr, FLATTEN: tl.constexpr, WS: tl.constexpr):
    per_blk: tl.constexpr = B // BN
    k_tiles: tl.constexpr = B // BK
    n_m = tl.cdiv(N, BM)
    per_m = NB * per_blk
    n_tiles = n_m * per_m
    for tile in tl.range(tl.program_id(0), n_tiles, NUM_SMS, flatten=FLATTEN,
                         warp_specialize=WS):
        pid_m = tile // per_m
        rem = tile % per_m
        j = rem // per_blk
        c0 = (rem % per_blk) * BN
        off_m = pid_m * BM
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kk in range(k_tiles):
            a = x_desc.load([off_m, j * B + kk * BK])
            if TRANS:
                bt = r_desc.load([j * B + c0, kk * BK])
                acc = tl.dot(a, bt.T, acc)
            else:
                bb = r_desc.load([j * B + kk * BK, c0])
                acc = tl.dot(a, bb, acc)
        o_desc.store([off_m, j * B + c0], acc.to(o_desc.dtype))


def rot(x, r, transpose=False, bm=128, bn=128, bk=64, warps=8, stages=3, flatten=False,
        ws=False, out=None, per_sm=1):
    n, w = x.shape
    nb, b, _ = r.shape
    if out is None:
        out = torch.empty_like(x)
    xd = TensorDescriptor.from_tensor(x, [bm, bk])
    rd = TensorDescriptor(r, [nb * b, b], [b, 1], [bn, bk] if transpose else [bk, bn])
    od = TensorDescriptor.from_tensor(out, [bm, bn])
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count * per_sm
    tiles = triton.cdiv(n, bm) * nb * (b // bn)
    if per_sm == 0:  # not persistent: one program per tile
        sms = tiles
    _rot_tma[(min(sms, tiles),)](xd, rd, od, n, nb, B=b, BM=bm, BN=bn, BK=bk, TRANS=transpose,
                                 NUM_SMS=sms, FLATTEN=flatten, WS=ws, num_warps=warps,
                                 num_stages=stages)
    return out


@triton.jit
def _outer_tma(a_desc, g_desc, o_desc, N, NB, B: tl.constexpr, BM: tl.constexpr,
               BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
               NUM_SMS: tl.constexpr):
    per_i: tl.constexpr = B // BM
    per_c: tl.constexpr = B // BN
    per_j = per_i * per_c
    n_tiles = NB * per_j * SPLIT
    k_len = N // SPLIT
    k_tiles = k_len // BK
    for tile in tl.range(tl.program_id(0), n_tiles, NUM_SMS):
        s = tile // (NB * per_j)
        rem = tile % (NB * per_j)
        j = rem // per_j
        rem2 = rem % per_j
        i0 = (rem2 // per_c) * BM
        c0 = (rem2 % per_c) * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kk in range(k_tiles):
            k0 = s * k_len + kk * BK
            at = a_desc.load([k0, j * B + i0])
            gg = g_desc.load([k0, j * B + c0])
            acc = tl.dot(at.T, gg, acc)
        o_desc.store([s * NB * B + j * B + i0, c0], acc.to(o_desc.dtype))


@triton.jit
def _sum_split(p_ptr, o_ptr, M, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M
    acc = tl.load(p_ptr + offs, mask=mask)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(p_ptr + s * M + offs, mask=mask)
    tl.store(o_ptr + offs, acc.to(o_ptr.dtype.element_ty), mask=mask)


def outer(a, g, nb, split=1, bm=128, bn=128, bk=64, warps=8, stages=3, out_dtype=None):
    n, w = a.shape
    b = w // nb
    out_dtype = out_dtype or a.dtype
    ad = TensorDescriptor.from_tensor(a, [bk, bm])
    gd = TensorDescriptor.from_tensor(g, [bk, bn])
    if split == 1:
        out = torch.empty(nb, b, b, device=a.device, dtype=out_dtype)
        part = out
    else:
        out = torch.empty(nb, b, b, device=a.device, dtype=out_dtype)
        part = torch.empty(split, nb, b, b, device=a.device, dtype=torch.float32)
    od = TensorDescriptor(part, [split * nb * b, b], [b, 1], [bm, bn])
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    tiles = nb * (b // bm) * (b // bn) * split
    _outer_tma[(min(sms, tiles),)](ad, gd, od, n, nb, B=b, BM=bm, BN=bn, BK=bk, SPLIT=split,
                                   NUM_SMS=sms, num_warps=warps, num_stages=stages)
    if split > 1:
        m = nb * b * b
        _sum_split[(triton.cdiv(m, 1024),)](part, out, m, SPLIT=split, BLOCK=1024)
    return out


def _trial(call, measure):
    """Run ``call`` once, ``measure(output)`` it, then time it: ``(µs, measure)``, or the
    exception that compiling or running it raised (e.g. too little shared memory)."""
    try:
        o = call()
        torch.cuda.synchronize()
        m = measure(o)
        return gtime(call), m
    except Exception as e:  # noqa: BLE001
        return e


def _record(res, name, tag, t, line):
    """A :func:`_trial` result ``t``: its exception printed, or ``[µs, error]`` stored under
    ``name`` and ``"tag µs (error)"`` added to the printed ``line``."""
    if isinstance(t, Exception):
        print(f"   {tag}: {type(t).__name__}: {str(t)[:160]}", flush=True)
        return
    us, err = t
    res[name] = [us, err]
    line.append(f"{tag} {us:6.1f} ({err:.1e})")


def _dump(res, path):
    if path:
        with open(path, "w") as f:
            json.dump(res, f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--occupancy", action="store_true",
                    help="only the rotation at 4096 wide, with small tiles at 1 and 2 programs "
                         "per SM and one program per tile")
    args = ap.parse_args()
    if args.occupancy:
        return occupancy(args)
    dev, dt = torch.device("cuda"), torch.bfloat16
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__}
    print(res, flush=True)
    torch.manual_seed(0)
    T = 4096
    rot_cfgs = [(128, 128, 64, 4, 4), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3),
                (128, 256, 64, 8, 4), (256, 128, 64, 8, 3), (128, 128, 128, 8, 3)]
    for n_w in (4096, 14336):
        x = torch.randn(T, n_w, device=dev, dtype=dt)
        g = torch.randn(T, n_w, device=dev, dtype=dt)
        for b in (256, 512):
            nb = n_w // b
            r = (torch.randn(nb, b, b, device=dev) / b**0.5).to(dt)
            key = f"{n_w}_b{b}"
            for tr in (False, True):
                ref = _rotate(x, r, transpose=tr)
                cub = gtime(lambda: _rotate(x, r, transpose=tr))
                res[f"{key}_rot{'T' if tr else ''}_cublas"] = cub
                line = [f"{key} rot{'T' if tr else ' '} cublas {cub:6.1f}"]
                out = torch.empty_like(x)
                for cfg in rot_cfgs:
                    bm, bn, bk, w, st = cfg
                    if b % bn:
                        continue
                    for fl, ws in ((False, False), (True, False), (False, True)):
                        tag = f"{cfg}{'F' if fl else ''}{'W' if ws else ''}"
                        t = _trial(lambda: rot(x, r, tr, bm, bn, bk, w, st, fl, ws, out=out),
                                   lambda o: (o.float() - ref.float()).abs().max().item())
                        _record(res, f"{key}_rot{'T' if tr else ''}_{tag}", tag, t, line)
                print(" | ".join(line), flush=True)
            oref = _outer(x, g, nb)
            cub = gtime(lambda: _outer(x, g, nb))
            res[f"{key}_outer_cublas"] = cub
            line = [f"{key} outer cublas {cub:6.1f}"]
            for split in (1, 2, 4):
                for cfg in ((128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (128, 128, 64, 8, 4),
                            (128, 256, 64, 8, 3)):
                    bm, bn, bk, w, st = cfg
                    tag = f"s{split}{cfg}"
                    t = _trial(lambda: outer(x, g, nb, split, bm, bn, bk, w, st),
                               lambda o: ((o.float() - oref.float()).abs().max()
                                          / oref.float().abs().max()).item())
                    _record(res, f"{key}_outer_{tag}", tag, t, line)
            print(" | ".join(line), flush=True)
    _dump(res, args.out)


def occupancy(args):
    """Can co-resident programs (two per SM, or one per tile) overlap one tile's epilogue
    with another's products, as a ping-pong schedule would? 4096 wide, b = 256 and 512."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    res = {"device": torch.cuda.get_device_name(), "triton": triton.__version__}
    torch.manual_seed(0)
    x = torch.randn(4096, 4096, device=dev, dtype=dt)
    out = torch.empty_like(x)
    cfgs = [(128, 128, 64, 4, 2), (128, 128, 64, 4, 3), (64, 256, 64, 4, 2),
            (64, 128, 64, 4, 3), (128, 256, 64, 8, 2), (128, 256, 64, 8, 3),
            (128, 128, 128, 8, 3)]
    for b in (256, 512):
        r = (torch.randn(4096 // b, b, b, device=dev) / b**0.5).to(dt)
        for tr in (False, True):
            ref = _rotate(x, r, transpose=tr)
            key = f"b{b}_rot{'T' if tr else ''}"
            res[f"{key}_cublas"] = gtime(lambda: _rotate(x, r, transpose=tr))
            line = [f"{key} cublas {res[f'{key}_cublas']:.1f}"]
            for cfg in cfgs:
                bm, bn, bk, w, st = cfg
                for per_sm, fl in ((1, True), (2, True), (2, False), (0, False)):
                    tag = f"{cfg}x{per_sm}{'F' if fl else ''}"
                    t = _trial(lambda: rot(x, r, tr, bm, bn, bk, w, st, fl, False, out=out,
                                           per_sm=per_sm),
                               lambda o: torch.equal(o, ref))
                    if isinstance(t, Exception):
                        line.append(f"{tag} {type(t).__name__}")
                        continue
                    us, same = t
                    res[f"{key}_{tag}"] = [us, same]
                    line.append(f"{tag} {us:.1f}{'' if same else ' (bits differ)'}")
            print(" | ".join(line), flush=True)
    _dump(res, args.out)


if __name__ == "__main__":
    main()
