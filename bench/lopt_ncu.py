"""A few learned-optimizer steps on a model's shapes, eager (no CUDA graph), for a profiler.

    ncu --clock-control none -k regex:sfc_fold_fused --launch-skip 2 --launch-count 1 \\
        --set full -o sfc python3 bench/lopt_ncu.py --method small_fc_lopt --model vit_b16

Builds the optimizer as ``bench/lopt_step.py`` does (its shapes, seeds and
hyperparameters), turns the step's CUDA graph off so that every kernel is an ordinary
launch (Nsight Compute then sees each one by name), and runs ``--steps`` steps. The
kernels are the ones a graph replays; only the host's launches differ.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lopt_step as B  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", choices=("small_fc_lopt", "velo"), default="small_fc_lopt")
    ap.add_argument("--model", choices=tuple(B.MODELS), default="vit_b16")
    ap.add_argument("--precision", choices=("exact", "fast"), default="exact")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    os.environ["XOPT_LOPT_CUDA_GRAPHS"] = "0"  # read when the first step builds its recorder
    params = B.make(B.MODELS[args.model]())
    opt, loss = B.build(args.method, params, "triton", args.precision)
    for _ in range(args.steps):
        opt.step(loss=loss) if loss is not None else opt.step()
    torch.cuda.synchronize()
    print(f"{args.method} {args.precision} on {args.model}: {args.steps} eager steps")


if __name__ == "__main__":
    main()
