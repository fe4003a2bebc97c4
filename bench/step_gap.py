"""How much of a step timed one at a time is the GPU waiting for the host: fused AdamW
against a learned optimizer's Triton step (CUDA, ViT-B/16's shapes by default).

    python3 bench/step_gap.py [--method small_fc_lopt|velo] [--model vit_b16] [--steps 50]

Prints, for the Triton path (exact mode) and for torch's fused AdamW: the host's time per
step (``perf_counter`` around ``--steps`` back-to-back steps, before synchronizing), the
GPU's time per step back to back, the median of steps timed one at a time as
``bench/lopt_step.py`` times them (each between two CUDA events, then a synchronization,
so each includes the host's work before its first kernel); then ``cProfile``'s top
functions by own time over the same steps (the learned optimizer only; the phases and
per-tensor passes of the host's work: bench/lopt_host.py).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lopt_step as B  # noqa: E402


def host_and_gpu(opt, loss, steps: int) -> dict[str, float]:
    r = B.back_to_back(opt, loss, steps)
    one = B.timed_steps(opt, loss, steps)
    return {"host_ms": r["host_ms"], "back_to_back_ms": r["back_to_back_ms"],
            "one_at_a_time_median_ms": statistics.median(one)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", default="small_fc_lopt")
    ap.add_argument("--model", default="vit_b16")
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args()
    shapes = B.MODELS[args.model]()
    print(torch.cuda.get_device_name(), torch.__version__, args.method, args.model,
          f"{len(shapes)} tensors", flush=True)
    for method in ("adamw", args.method):
        params = B.make(shapes)
        opt, loss = B.build(method, params, "triton")
        for _ in range(5):
            B._step(opt, loss)
        r = host_and_gpu(opt, loss, args.steps)
        print(method, "  ".join(f"{k} {v:.3f}" for k, v in r.items()), flush=True)
        if method != "adamw":
            torch.cuda.synchronize()
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(args.steps):
                B._step(opt, loss)
            pr.disable()
            torch.cuda.synchronize()
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
            print(s.getvalue(), flush=True)
        del opt, params
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
