"""Rowloop gather settings (rows per program, column chunk, warps) at widths 4096 and 14336
(4096 tokens, bf16), against a copy: the sweep behind poet_perm's defaults (fifth session).

    PYTHONPATH=$PWD python3 bench/poet_probe/gather_chunks.py
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from graph_time import gtime  # noqa: E402

from xopt.kernels import poet_perm as PP  # noqa: E402

dev = torch.device("cuda")
dt = torch.bfloat16
for d in (4096, 14336):
    x = torch.randn(4096, d, device=dev, dtype=dt)
    p = torch.randperm(d, device=dev).to(torch.int32)
    print(f"d={d}: copy {gtime(lambda: x.clone()):.1f} us", flush=True)
    for rows in (1, 2):
        for bd in (2048, 4096, 8192, 16384):
            for w in (4, 8, 16):
                if bd > 2 * d:
                    continue
                PP.ROWLOOP.update(rows=rows, block_d=bd, warps=w)
                o = PP.gather(x, p)
                ok = torch.equal(o, x[:, p.long()])
                us = gtime(lambda: PP.gather(x, p))
                print(f"  rows={rows} block_d={bd} warps={w}: {us:.1f} us {ok}", flush=True)
