"""small_fc_lopt's Triton step under the folded fused kernel's tuning knobs, in one process.

    python bench/sfc_sweep.py [--models vit_b16] [--variants A,B,...]

For each variant (module constants of :mod:`xopt.kernels.small_fc_lopt` set before the
optimizer is built, so each compiles its own kernel; the CUDA graph on or off): the
median ms of ``step()`` (CUDA events, after warm-up) on the model's shapes, and how far
one step from a fixed state moves the parameters and the state from the first variant's
(max over tensors of max|a−b| / max|b|). Prints one line per variant, and fused AdamW's
time for the ratio.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import lopt_step as B  # noqa: E402

import xopt.torch as xt  # noqa: E402
from xopt.kernels import lopt_common as C  # noqa: E402
from xopt.kernels import small_fc_lopt as K  # noqa: E402

#: the settings before the knobs below (commit 69e2d5c's kernels)
OLD = dict(PREFETCH=False, AB_ACC=False, SPLIT_LO="rn", MAXNREG_FOLD=168, SA_G2=4)
#: name -> (module constants, CUDA graph on[, precision]); a constant not named keeps the
#: module's value
#: (the variants from "ab" on were measured with MAXNREG_FOLD = 168 and SA_G2 = 4 defaults)
VARIANTS = {
    "base_eager": (OLD, False),
    "base": (OLD, True),
    "ab": (dict(PREFETCH=False, AB_ACC=True, SPLIT_LO="rn"), True),
    "ab_pf": (dict(PREFETCH=True, AB_ACC=True, SPLIT_LO="rn"), True),
    "ab_hw": (dict(PREFETCH=False, AB_ACC=True, SPLIT_LO="hw"), True),
    "ab_hw_pf": (dict(PREFETCH=True, AB_ACC=True, SPLIT_LO="hw"), True),
    "ab_pf_nocap": (dict(PREFETCH=True, AB_ACC=True, SPLIT_LO="rn", MAXNREG_FOLD=0), True),
    "ab_hw_pf_nocap": (dict(PREFETCH=True, AB_ACC=True, SPLIT_LO="hw", MAXNREG_FOLD=0), True),
    "ab_pf_st2": (dict(PREFETCH=True, AB_ACC=True, SPLIT_LO="rn", STAGES_FOLD=2), True),
    "defaults": ({}, True),
    "defaults_g2_sa4": (dict(SA_G2=4), True),
    "defaults_eager": ({}, False),
    # fifth session: statistics kernel (its own PREFETCH, register cap, rows and warps),
    # fused kernel (RA), g² pass sub-tile. (Variants of knobs measured slower and removed
    # afterwards, CAT2 / CAT1, PF_AXIS, OFF32, ran at commit f018735; small_fc_lopt.py's
    # comment at PREFETCH_STATS gives their figures.)
    "st_pf96": (dict(PREFETCH_STATS=True, MAXNREG_STATS=96), True),
    "st_pf80": (dict(PREFETCH_STATS=True), True),
    "ra2": (dict(RA=2), True),
    "ra4": (dict(RA=4), True),
    "g2_64": (dict(SA_G2=64), True),
    "g2_8": (dict(SA_G2=8), True),
    "g2_4": (dict(SA_G2=4), True),
    "terms4": (dict(TERMS=4), True),
    # (ninth session: float16 halves, F16 = True, against "tf32" = F16=False and "terms4",
    # ran at commit 79ae17d and were removed; figures in bench/RESULTS.md)
    "fast": (dict(), True, "fast"),
    "ra2_fast": (dict(RA=2), True, "fast"),
    "st72": (dict(MAXNREG_STATS=72), True),
    "st_w2": (dict(SA_STATS_FOLD=1, WARPS_STATS=2, MAXNREG_STATS=64), True),
    "ra2_st72": (dict(RA=2, MAXNREG_STATS=72), True),
    "ra2_st_w2": (dict(RA=2, SA_STATS_FOLD=1, WARPS_STATS=2, MAXNREG_STATS=64), True),
    # the fifth session's defaults before them (RA 1, statistics kernel 2 rows, 4 warps,
    # cap 80, g² sub-tile 16), and the g² pass's sub-tile and warps
    "prev": (dict(RA=1, SA_STATS_FOLD=2, WARPS_STATS=4, MAXNREG_STATS=80, SA_G2=16), True),
    "g2_2": (dict(SA_G2=2), True),
    "g2_1": (dict(SA_G2=1), True),
    "g2_16": (dict(SA_G2=16), True),
    "g2_4w2": (dict(SA_G2=4, G2_WARPS=2), True),
    "g2_2w2": (dict(SA_G2=2, G2_WARPS=2), True),
    "sa4w8": (dict(SA_FOLD=4, WARPS_FOLD=8), True),
    "sa1": (dict(SA_FOLD=1), True),
    "sa1_cap168": (dict(SA_FOLD=1, MAXNREG_FOLD=168), True),
    "sa1_cap160": (dict(SA_FOLD=1, MAXNREG_FOLD=160), True),
    "sa1_cap168_ra4": (dict(SA_FOLD=1, MAXNREG_FOLD=168, RA=4), True),
    "sa1_cap168_ra1": (dict(SA_FOLD=1, MAXNREG_FOLD=168, RA=1), True),
    "nopf": (dict(PREFETCH=False), True),
    "nopf_cap168": (dict(PREFETCH=False, MAXNREG_FOLD=168), True),
    "cap168": (dict(MAXNREG_FOLD=168), True),
    "st_cap56": (dict(MAXNREG_STATS=56), True),
    "g2_8w8": (dict(SA_G2=8, G2_WARPS=8), True),
    "g2_32": (dict(SA_G2=32), True),
}

#: kernels whose per-step CUDA time --profile prints (name prefixes)
PROFILED = ("sfc_fold_fused", "sfc_fold_stats", "stats1", "sfc_fused", "sfc_stats")


def gap_ms(opt, steps: int = 20) -> dict[str, float]:
    """Where a step's time goes besides its kernels: ms per step of ``steps`` steps back to
    back (CUDA events around all of them, no synchronization between), of the host alone
    (``perf_counter`` around the same loop, before synchronizing), and the CUDA time of
    every kernel of one step (torch.profiler, 2 steps)."""
    from torch.profiler import ProfilerActivity, profile

    r = B.back_to_back(opt, None, steps)
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(2):
            opt.step()
        torch.cuda.synchronize()
    total = 0.0
    for e in p.key_averages():
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = e.self_cuda_time_total
        total += t
    return {**r, "all_kernels_ms": total / 1e3 / 2}


def kernel_ms(opt, steps: int = 2, every: bool = False) -> dict[str, float]:
    """CUDA time per step of the main kernels (torch.profiler over ``steps`` steps); of
    every kernel (by name, the first 60 characters) if ``every``."""
    out: dict[str, float] = {}
    for name, ms in B.profile_kernels(opt.step, steps).items():
        for k in ((name[:60],) if every else PROFILED):
            if name.startswith(k):
                out[k] = out.get(k, 0.0) + ms
    return out


class _Warps:
    """``stats1_kernel`` launched with ``num_warps`` (measurement only: the variants'
    ``G2_WARPS``; :func:`xopt.kernels.lopt_common.factored_pass` launches it with 4)."""

    def __init__(self, kern, warps: int) -> None:
        self.kern, self.warps = kern, warps

    def __getitem__(self, grid):
        launch = self.kern[grid]
        return lambda *a, **kw: launch(*a, num_warps=self.warps, **kw)


def set_g2_warps(warps: int) -> None:
    base = C.stats1_kernel.kern if isinstance(C.stats1_kernel, _Warps) else C.stats1_kernel
    C.stats1_kernel = base if warps == 4 else _Warps(base, warps)


def one_step_state(shapes, seed: int = 3, precision: str = "exact"):
    params = B.make(shapes, torch.float32, seed=seed)
    opt = xt.SmallFCLOpt(params, impl="triton", precision=precision, **B.SMALL_FC)
    opt.step()
    return opt, params


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="vit_b16")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--profile", action="store_true",
                    help="also print each variant's main kernels' CUDA time per step")
    ap.add_argument("--kernels", action="store_true",
                    help="also print every kernel's CUDA time per step (torch.profiler)")
    ap.add_argument("--check", action="store_true",
                    help="also print each variant's step, parameters and state against the "
                    "plain path's in float64 (bench/lopt_step.py's check_exact)")
    ap.add_argument("--gap", action="store_true",
                    help="also print the step's time back to back (no synchronization "
                    "between steps), the host's time per step and all kernels' CUDA time")
    args = ap.parse_args()
    defaults = {k: getattr(K, k) for c, *_ in VARIANTS.values() for k in c if k != "G2_WARPS"}
    print(torch.cuda.get_device_name(), "defaults", defaults, flush=True)
    for model in args.models.split(","):
        shapes = B.MODELS[model]()
        params = B.make(shapes)
        adam = B.time_step(torch.optim.AdamW(params, lr=1e-3, fused=True), None, 3, args.reps)
        del params
        torch.cuda.empty_cache()
        print(f"== {model}: adamw/fused {adam['median_ms']:.3f} ms", flush=True)
        ref = None
        for name in args.variants.split(","):
            consts, graphs, *prec = VARIANTS[name]
            for k, v in defaults.items():
                setattr(K, k, consts.get(k, v))
            set_g2_warps(consts.get("G2_WARPS", 4))
            try:
                # one step from a fixed state (a first step from zeros, then the timed one)
                opt, params = one_step_state(shapes, precision=(prec or ["exact"])[0])
                for p, g in zip(params, B.make(shapes, torch.float32, seed=4), strict=True):
                    p.grad = g.grad
                opt._triton._graph.enabled = graphs
                opt.step()
                res = ([p.detach().clone() for p in params],
                       [{k: v.clone() for k, v in opt.state[p].items()} for p in params])
                if ref is None:
                    ref = res
                    dp = ds = 0.0
                else:
                    dp = max(B.rel(a, b) for a, b in zip(res[0], ref[0], strict=True))
                    ds = max(B.rel(a[k], b[k]) for a, b in zip(res[1], ref[1], strict=True)
                             for k in b)
                r = B.time_step(opt, None, 3, args.reps)
                rec = opt._triton.graph_recordings
                prof = kernel_ms(opt) if args.profile else {}
                every = kernel_ms(opt, every=True) if args.kernels else {}
                gap = gap_ms(opt) if args.gap else {}
                del opt, params, res
                torch.cuda.empty_cache()
                x = r["median_ms"] / adam["median_ms"]
                print(f"{name:16s} {r['median_ms']:8.3f} ms  x{x:5.2f}"
                      f"  min {r['min_ms']:.3f}  graphs {graphs} (recorded {rec})  vs first: "
                      f"params {dp:.2e} state {ds:.2e}  peak extra "
                      f"{r['peak_extra_bytes'] / 2**20:.1f} MiB", flush=True)
                if gap:
                    print("    " + "  ".join(f"{k} {v:.3f}" for k, v in gap.items()), flush=True)
                if prof:
                    print("    kernels ms/step: " + "  ".join(
                        f"{k} {v:.3f}" for k, v in prof.items()), flush=True)
                if args.kernels:
                    print(f"    every kernel, ms/step (total {sum(every.values()):.3f}):")
                    for k, v in sorted(every.items(), key=lambda kv: -kv[1]):
                        print(f"      {v:8.4f}  {k}", flush=True)
                if args.check:
                    chk = B.check_exact("small_fc_lopt", shapes, (prec or ["exact"])[0])
                    print("    vs plain (float64): " + "  ".join(
                        f"{k} {v:.3e}" if isinstance(v, float) else f"{k} {v}"
                        for k, v in chk.items()), flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"{name:16s} failed: {type(e).__name__}: {e}", flush=True)
    for k, v in defaults.items():
        setattr(K, k, v)


if __name__ == "__main__":
    main()
