"""Probe: can small_fc_lopt's statistics pass run beside its fused pass?

    python3 bench/sfc_overlap_probe.py [--model vit_b16] [--reps 10]

The fused kernel is bound by latency at two programs per SM and uses a quarter of DRAM's
bandwidth; the statistics kernel is bound by DRAM. If the statistics pass of one group of
tensors could run while another group's fused pass runs, a pipelined step could hide most
of it. This probe only measures whether the two kernels overlap at all on the GPU: one
eager step (CUDA graphs off) records both folded kernels' launch arguments; then each
kernel alone, the two one after the other, and the two launched together on two streams
(the fused pass first), with the fused kernel's register cap at the default (244
registers: 2 programs per SM use 62,464 of 65,536 registers, too few left for a statistics
program of 2 warps × 64 registers) and at 240 and 232. The relaunched kernels keep updating
the same state; the values are not checked (timing only). GPU ms, CUDA events, medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

os.environ["XOPT_LOPT_CUDA_GRAPHS"] = "0"

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import lopt_step as B  # noqa: E402

from xopt.kernels import small_fc_lopt as K  # noqa: E402

captured: dict = {}


class _Spy:
    def __init__(self, name, kern):
        self.name, self.kern = name, kern

    def __getitem__(self, grid):
        def launch(*args, **kw):
            captured.setdefault(self.name, (grid, args, dict(kw)))
            return self.kern[grid](*args, **kw)
        return launch


def timed(fn, reps: int) -> float:
    """Median ms of ``reps`` calls timed one at a time (``lopt_step.timed_calls``)."""
    torch.cuda.synchronize()
    return statistics.median(B.timed_calls(fn, reps))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="vit_b16")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    shapes = B.MODELS[args.model]()
    params = B.make(shapes)
    opt, _ = B.build("small_fc_lopt", params, "triton")
    opt.step()
    saved = {n: getattr(K, n) for n in ("sfc_fold_stats_kernel", "sfc_fold_fused_kernel")}
    for n, k in saved.items():
        setattr(K, n, _Spy(n, k))
    try:
        opt.step()
    finally:
        for n, k in saved.items():
            setattr(K, n, k)
    sg, sa, skw = captured["sfc_fold_stats_kernel"]
    fg, fa, fkw = captured["sfc_fold_fused_kernel"]
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    print(torch.cuda.get_device_name(), args.model, "stats grid", sg, "fused grid", fg,
          flush=True)

    def stats():
        saved["sfc_fold_stats_kernel"][sg](*sa, **skw)

    for cap in (0, 240, 232):
        kw = dict(fkw)
        if cap:
            kw["maxnreg"] = cap
        else:
            kw.pop("maxnreg", None)

        def fused(kw=kw):
            saved["sfc_fold_fused_kernel"][fg](*fa, **kw)

        def both():
            cur = torch.cuda.current_stream()
            s1.wait_stream(cur)
            s2.wait_stream(cur)
            with torch.cuda.stream(s1):
                fused()
            with torch.cuda.stream(s2):
                stats()
            cur.wait_stream(s1)
            cur.wait_stream(s2)

        fused()
        stats()
        both()
        t_f, t_s = timed(fused, args.reps), timed(stats, args.reps)
        t_seq = timed(lambda: (fused(), stats()), args.reps)
        t_both = timed(both, args.reps)
        k = saved["sfc_fold_fused_kernel"]
        regs = "?"
        try:  # the compiled kernel's registers, where this Triton exposes them
            regs = next(iter(k.device_caches[0][0].values())).n_regs if not cap else cap
        except Exception:  # noqa: BLE001
            pass
        print(f"fused cap {cap or '-':>4} (regs {regs}): fused {t_f:.3f}  stats {t_s:.3f}  "
              f"sequential {t_seq:.3f}  two streams {t_both:.3f}  "
              f"(saved {t_seq - t_both:+.3f} ms)", flush=True)


if __name__ == "__main__":
    main()
