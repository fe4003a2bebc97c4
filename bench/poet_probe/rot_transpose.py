"""The backward's block rotations ``x · r[j]ᵀ``: cuBLAS on the transposed view of ``r``
(what the layer does) against a contiguous transposed copy of ``r`` (the copy timed too),
and the forward rotation ``x · r[j]`` beside them.

    PYTHONPATH=$PWD python3 bench/poet_probe/rot_transpose.py

H100, bf16, 4096 tokens × 4096, b = 256 and 512; GPU µs per call (graph_time.gtime).
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from graph_time import gtime  # noqa: E402

from xopt.torch.poet import _rotate  # noqa: E402

if __name__ == "__main__":
    dev, dt = torch.device("cuda"), torch.bfloat16
    x = torch.randn(4096, 4096, device=dev, dtype=dt)
    for b in (256, 512):
        r = torch.randn(4096 // b, b, b, device=dev, dtype=dt) / b ** 0.5
        rt = r.transpose(1, 2).contiguous()
        assert torch.equal(_rotate(x, r, transpose=True), _rotate(x, rt))
        res = {"x·r": gtime(lambda r=r: _rotate(x, r)),
               "x·rᵀ (view)": gtime(lambda r=r: _rotate(x, r, transpose=True)),
               "x·rᵀ (copy)": gtime(lambda rt=rt: _rotate(x, rt)),
               "copy of rᵀ": gtime(lambda r=r: r.transpose(1, 2).contiguous())}
        print(f"b={b}: " + ", ".join(f"{k} {v:.1f} us" for k, v in res.items()), flush=True)
