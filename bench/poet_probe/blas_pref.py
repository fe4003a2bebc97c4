"""Does cuBLASLt (``torch.backends.cuda.preferred_blas_library``) pick faster kernels than
cuBLAS for the fast layer's block products and matmuls (twelfth session)? GPU µs from
CUDA-graph replays, bf16, 4096 tokens; whether each output has cuBLAS's bits.

    PYTHONPATH=$PWD python3 bench/poet_probe/blas_pref.py
"""

import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from graph_time import fwd_bwd, gtime  # noqa: E402

from xopt.torch.poet import POETLinear, _outer, _rotate  # noqa: E402

dev, dt = torch.device("cuda"), torch.bfloat16
T = 4096


def main():
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    torch.manual_seed(0)
    for n, b in ((4096, 256), (4096, 512), (14336, 512)):
        nb = n // b
        x = torch.randn(T, n, device=dev, dtype=dt)
        g = torch.randn(T, n, device=dev, dtype=dt)
        r = (torch.randn(nb, b, b, device=dev) / b**0.5).to(dt)
        w = torch.randn(n, n, device=dev, dtype=dt) / n**0.5 if n == 4096 else None
        calls = {"rot": lambda: _rotate(x, r), "rotT": lambda: _rotate(x, r, transpose=True),
                 "outer": lambda: _outer(x, g, nb)}
        if w is not None:
            calls["linear"] = lambda: nn.functional.linear(x, w)
            calls["mm"] = lambda: torch.mm(x, w)
        xl = torch.randn(T, 4096, device=dev, dtype=dt, requires_grad=True)
        gy = torch.randn(T, n, device=dev, dtype=dt)
        lin = nn.Linear(4096, n, bias=False, device=dev, dtype=dt)
        layer = POETLinear(4096, n, b, variant="fast", impl="triton", device=dev, dtype=dt)
        with torch.no_grad():
            layer.oft_R.normal_(0, 1e-3)
        calls["nn.Linear fwd+bwd"] = fwd_bwd(lin, xl, gy)
        calls["fast layer fwd+bwd"] = fwd_bwd(layer, xl, gy)
        ref = {}
        for lib in ("cublas", "cublaslt", "cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(lib)
            line = []
            for k, f in calls.items():
                out = f()
                if out is not None:
                    same = "" if k not in ref else (" =" if torch.equal(ref[k], out) else " ≠")
                    ref.setdefault(k, out.clone())
                else:
                    same = ""
                line.append(f"{k} {gtime(f):.1f}{same}")
            print(f"{n} b={b} {lib:8s}: " + " | ".join(line), flush=True)
        torch.backends.cuda.preferred_blas_library("cublas")


if __name__ == "__main__":
    main()
