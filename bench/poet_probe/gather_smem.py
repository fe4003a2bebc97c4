"""The permutation gather through shared memory (``poet_perm`` mode ``"smem"``: each row
read and written coalesced, permuted by ``tl.gather`` in shared memory) against the rowloop
gather (permuted reads through L1) and a plain copy; then the fast layer with each.

    PYTHONPATH=$PWD python3 bench/poet_probe/gather_smem.py

H100, bf16, 4096 tokens. Part 1: GPU µs per gather (CUDA-graph replays, graph_time.gtime)
at widths 4096 and 14336, smem at 1/2/4 rows per program and 4-32 warps, each output
checked against ``index_select``. Part 2: GPU ms of the fast layer's forward+backward
(one graph replay) at 4096² b = 256 / 512 and 4096→14336 b = 256 with MODE rowloop and
smem (at its defaults), two interleaved rounds, nn.Linear beside them.
"""

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from graph_time import fwd_bwd, gtime  # noqa: E402

from xopt.kernels import poet_perm as PP  # noqa: E402
from xopt.torch.poet import POETLinear  # noqa: E402


def gathers():
    dev, dt = torch.device("cuda"), torch.bfloat16
    for d in (4096, 14336):
        x = torch.randn(4096, d, device=dev, dtype=dt)
        p = torch.randperm(d, device=dev).to(torch.int32)
        ref = x.index_select(-1, p.long())
        res = {"copy": gtime(lambda x=x: x.clone())}
        PP.MODE = "rowloop"
        assert torch.equal(PP.gather(x, p), ref)
        res["rowloop"] = gtime(lambda x=x, p=p: PP.gather(x, p))
        PP.MODE = "smem"
        for rows in (1, 2, 4):
            for warps in ((4, 8, 16) if d <= 4096 else (8, 16, 32)):
                PP.SMEM.update(rows=rows, warps=warps)
                assert torch.equal(PP.gather(x, p), ref), (d, rows, warps)
                res[f"smem r{rows} w{warps}"] = gtime(lambda x=x, p=p: PP.gather(x, p))
        PP.SMEM.update(rows=None, warps=None)
        print(f"gather {4096}x{d} bf16, GPU us: "
              + ", ".join(f"{k} {v:.1f}" for k, v in res.items()), flush=True)


def layers():
    dev, dt = torch.device("cuda"), torch.bfloat16
    for n_in, n_out, b in ((4096, 4096, 256), (4096, 4096, 512), (4096, 14336, 256)):
        x = torch.randn(1, 4096, n_in, device=dev, dtype=dt, requires_grad=True)
        g = torch.randn(1, 4096, n_out, device=dev, dtype=dt)
        lin = nn.Linear(n_in, n_out, bias=False, device=dev, dtype=dt)
        layer = POETLinear(n_in, n_out, b, variant="fast", impl="triton", device=dev,
                           dtype=dt)
        with torch.no_grad():
            layer.oft_R.normal_(0, 1e-3)
        line = []
        for r in range(2):
            t_lin = gtime(fwd_bwd(lin, x, g), reps=10) / 1e3
            for mode in ("rowloop", "smem"):
                PP.MODE = mode
                t = gtime(fwd_bwd(layer, x, g), reps=10) / 1e3
                line.append(f"r{r} {mode} {t:.3f} ms ({t / t_lin:.3f}x)")
            line.append(f"r{r} nn.Linear {t_lin:.3f}")
        PP.MODE = "auto"
        print(f"layer {n_in}->{n_out} b={b}, graph fwd+bwd: " + ", ".join(line), flush=True)


if __name__ == "__main__":
    gathers()
    layers()
