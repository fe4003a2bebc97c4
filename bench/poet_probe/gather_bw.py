"""How close the permutation gather comes to the GPU's memory bandwidth (4096 × 4096 bf16).

    PYTHONPATH=$PWD python3 bench/poet_probe/gather_bw.py [--width 4096]

The fast layer's four gathers took 19.1 µs each on the H200 (twelfth session), a copy
17.8, against 13.3 µs for 64 MiB at the H200's 4.8 TB/s. GPU µs from CUDA-graph replays
(``graph_time.gtime``), each result checked against ``index_select``:

* ``copy``: ``out.copy_(x)``; ``tcopy``: a Triton copy of 1-d blocks (``BLOCK`` elements
  per program, ``W`` warps);
* ``smem``: xopt's gather as committed (one row per program), at 2-16 warps;
* ``pf``: the smem gather with ``R`` rows per program, the next row's load issued before
  the current row is permuted and stored (a hand prefetch);
* ``+cs`` / ``+ef``: the same with streaming stores (``.cs``) or loads marked
  ``evict_first``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from graph_time import gtime  # noqa: E402

from xopt.kernels import poet_perm  # noqa: E402


@triton.jit
def _tcopy(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=m), mask=m)


@triton.jit
def _pf_kernel(x_ptr, idx_ptr, out_ptr, N, D, s_x, s_o, ROWS: tl.constexpr,
               BLOCK_D: tl.constexpr, CS: tl.constexpr, EF: tl.constexpr):
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    idx = tl.load(idx_ptr + cols, mask=cmask, other=0)
    row0 = tl.program_id(0) * ROWS
    ev: tl.constexpr = "evict_first" if EF else ""
    v = tl.load(x_ptr + row0.to(tl.int64) * s_x + cols,
                mask=cols < tl.where(row0 < N, D, 0), other=0.0, eviction_policy=ev)
    for i in range(ROWS):
        row = row0 + i
        nxt = row + 1
        have_next = (i + 1 < ROWS) & (nxt < N)
        v_next = tl.load(x_ptr + nxt.to(tl.int64) * s_x + cols,
                         mask=cols < tl.where(have_next, D, 0), other=0.0,
                         eviction_policy=ev)
        mask = cols < tl.where(row < N, D, 0)
        p = tl.gather(v, idx, 0)
        if CS:
            tl.store(out_ptr + row.to(tl.int64) * s_o + cols, p, mask=mask,
                     cache_modifier=".cs")
        else:
            tl.store(out_ptr + row.to(tl.int64) * s_o + cols, p, mask=mask)
        v = v_next


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=4096)
    args = ap.parse_args()
    n, d = args.tokens, args.width
    dev = torch.device("cuda")
    x = torch.randn(n, d, device=dev, dtype=torch.bfloat16)
    idx = torch.randperm(d, device=dev).to(torch.int32)
    ref = x.index_select(1, idx.long())
    out = torch.empty_like(x)
    block_d = triton.next_power_of_2(d)
    print(f"device: {torch.cuda.get_device_name()}; {n} x {d} bf16; "
          f"{2 * x.numel() * 2 / 2**20:.0f} MiB moved per call")

    def report(name, fn, check=True):
        us = gtime(fn)
        ok = ""
        if check:
            ok = "ok" if torch.equal(out, ref) else "WRONG"
        tbs = 2 * x.numel() * 2 / (us * 1e-6) / 1e12
        print(f"{name:34s} {us:7.2f} us  {tbs:5.2f} TB/s  {ok}", flush=True)
        out.zero_()

    report("copy_", lambda: out.copy_(x), check=False)
    for block, w in ((4096, 4), (8192, 4), (8192, 8), (16384, 8), (16384, 16)):
        report(f"tcopy BLOCK={block} W={w}",
               lambda block=block, w=w: _tcopy[(triton.cdiv(x.numel(), block),)](
                   x, out, x.numel(), BLOCK=block, num_warps=w), check=False)
    for w in (2, 4, 8, 16):
        poet_perm.SMEM.update(rows=1, warps=w)
        report(f"smem rows=1 W={w}", lambda: poet_perm._smem_launch(x, idx, out))
    poet_perm.SMEM.update(rows=None, warps=None)
    for rows, w, cs, ef in ((2, 4, 0, 0), (4, 4, 0, 0), (8, 4, 0, 0), (4, 8, 0, 0),
                            (2, 2, 0, 0), (4, 2, 0, 0), (4, 4, 1, 0), (4, 4, 0, 1),
                            (4, 4, 1, 1), (1, 4, 1, 0)):
        report(f"pf rows={rows} W={w}{' +cs' if cs else ''}{' +ef' if ef else ''}",
               lambda rows=rows, w=w, cs=cs, ef=ef: _pf_kernel[(triton.cdiv(n, rows),)](
                   x, idx, out, n, d, x.stride(0), out.stride(0), ROWS=rows,
                   BLOCK_D=block_d, CS=bool(cs), EF=bool(ef), num_warps=w))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
