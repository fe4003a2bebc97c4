"""The fast layer's two outer products as one batched product (``xopt.torch.poet.PAIRED``,
at bfd0b08 only: measured and reverted, bench/RESULTS.md, eleventh session) against two,
side by side: GPU time of one forward+backward (CUDA-graph replays, interleaved rounds),
the backward's peak memory, and whether outputs and gradients agree.

    git checkout bfd0b08 -- xopt && PYTHONPATH=$PWD python3 bench/poet_probe/paired.py [--rounds 3]

bf16, 4096 tokens, LLaMA-8B-like shapes (bench/poet_layer.py's).
"""

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from graph_time import fwd_bwd, gtime  # noqa: E402

import xopt.torch.poet as P  # noqa: E402

SHAPES = ((4096, 4096, 256), (4096, 4096, 512), (4096, 14336, 256), (4096, 14336, 512))


def run(layer, x, gy):
    x.grad = None
    layer.oft_R.grad = None
    y = layer(x)
    y.backward(gy)
    return y.detach().clone(), x.grad.clone(), layer.oft_R.grad.clone()


def peak(layer, x, gy):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run(layer, x, gy)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for d_in, d_out, b in SHAPES:
        torch.manual_seed(0)
        lin = nn.Linear(d_in, d_out, device=dev, dtype=dt)
        layer = P.POETLinear(d_in, d_out, b, variant="fast", impl="triton", device=dev,
                             dtype=dt)
        with torch.no_grad():
            layer.oft_R.normal_(0, 1e-3)
        x = torch.randn(4096, d_in, device=dev, dtype=dt, requires_grad=True)
        gy = torch.randn(4096, d_out, device=dev, dtype=dt)
        res = {}
        for paired in (False, True):
            P.PAIRED = paired
            res[paired] = run(layer, x, gy)
        diffs = [(u.float() - v.float()).abs().max().item() / v.float().abs().max().item()
                 for u, v in zip(res[True], res[False], strict=True)]
        same = [torch.equal(u, v) for u, v in zip(res[True], res[False], strict=True)]
        mems = {}
        for paired in (False, True):
            P.PAIRED = paired
            mems[paired] = peak(layer, x, gy)
        times = {False: [], True: [], "lin": []}
        for _ in range(args.rounds):
            times["lin"].append(gtime(fwd_bwd(lin, x, gy)))
            for paired in (False, True):
                P.PAIRED = paired
                times[paired].append(gtime(fwd_bwd(layer, x, gy)))
        lin_us = min(times["lin"])
        print(f"{d_in}->{d_out} b={b}: nn.Linear {', '.join(f'{t:.1f}' for t in times['lin'])} us;"
              f" two outer {', '.join(f'{t:.1f}' for t in times[False])}"
              f" ({min(times[False]) / lin_us:.3f}x); paired "
              f"{', '.join(f'{t:.1f}' for t in times[True])} ({min(times[True]) / lin_us:.3f}x);"
              f" peak MiB {mems[False]:.0f} / {mems[True]:.0f}; y, gx, gR equal {same},"
              f" rel diff {', '.join(f'{d:.1e}' for d in diffs)}", flush=True)
    P.PAIRED = True
