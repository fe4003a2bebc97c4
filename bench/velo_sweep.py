"""VeLO's Triton step under its kernels' tuning knobs, in one process.

    python bench/velo_sweep.py [--models vit_b16] [--variants A,B,...]

For each variant (module constants of :mod:`xopt.kernels.velo` set before the optimizer is
built: sub-tile rows of the statistics and fused passes, warps, pipelining stages; each
combination compiles its own kernels): the median GPU time of one replay of the step's CUDA
graph (CUDA events, after warm-up), the median ms of ``step()`` (host included), the CUDA
time per step of the statistics and the fused kernels (torch.profiler, two replays), and how
far one step from a fixed state moves the parameters and the state from the first
variant's (max over tensors of max|a−b| / max|b|: the sums' order differs between
variants). Prints one line per variant.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import lopt_step as B  # noqa: E402

import xopt.torch as xt  # noqa: E402
from xopt.kernels import velo as K  # noqa: E402

#: name -> module constants of xopt.kernels.velo (a constant not named keeps its default;
#: the prefetch and carried-lanes variants went with their switches: their figures are in
#: xopt/kernels/velo.py's velo_fused_kernel, velo_stats_kernel and _mom_store)
VARIANTS = {
    "defaults": {},
    "nofold": dict(FOLD=False),
    "rawW": dict(NORM_W=False),
    "nofold_rawW": dict(FOLD=False, NORM_W=False),
    "f64var": dict(VAR_F32=False, P2_F32=False),
    "varonly": dict(P2_F32=False),
    "w8": dict(WARPS=8),
    "w2": dict(WARPS=2),
    "sa8w8": dict(SA=8, WARPS=8),
    "st1": dict(STAGES=1),
    "st3": dict(STAGES=3),
    "sa8": dict(SA=8),
    "sa2": dict(SA=2),
    "sast4": dict(SA_STATS=4),
    "sast1": dict(SA_STATS=1),
    "varf32": dict(VAR_F32=True),
    "varp2f32": dict(VAR_F32=True, P2_F32=True),
    "st_cap96": dict(MAXNREG_STATS=96),
    "st_cap80": dict(MAXNREG_STATS=80),
    "st_cap72": dict(MAXNREG_STATS=72),
    "st_cap64": dict(MAXNREG_STATS=64),
    "fu_cap128": dict(MAXNREG=128),
    "fu_cap96": dict(MAXNREG=96),
    "fu_cap80": dict(MAXNREG=80),
    "defaults_again": {},
}
#: the environment variable of each knob (read when xopt.kernels.velo is imported)
ENV = {"SA": "XOPT_LOPT_SA_FMA", "SA_STATS": "XOPT_LOPT_SA_STATS", "WARPS": "XOPT_LOPT_WARPS",
       "STAGES": "XOPT_LOPT_STAGES", "VAR_F32": "XOPT_VELO_VAR_F32",
       "P2_F32": "XOPT_VELO_P2_F32", "FOLD": "XOPT_VELO_FOLD",
       "NORM_W": "XOPT_VELO_NORM_W", "MAXNREG_STATS": "XOPT_VELO_MAXNREG_STATS",
       "MAXNREG": "XOPT_VELO_MAXNREG"}
KNOBS = ("SA", "SA_STATS", "WARPS", "STAGES", "VAR_F32", "P2_F32", "FOLD", "NORM_W",
         "MAXNREG_STATS", "MAXNREG")


def kernel_ms(graph, n: int = 2, every: bool = False) -> dict[str, float]:
    """CUDA ms per replay of each velo_* / stats kernel (torch.profiler over ``n``); of
    every kernel (its name's first 60 characters) if ``every``."""
    out: dict[str, float] = {}
    for name, ms in B.profile_kernels(graph.replay, n).items():
        if every or "velo_" in name or "stats1" in name:
            key = name[:60] if every else name.split("(")[0][:24]
            out[key] = round(out.get(key, 0.0) + ms, 4)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="vit_b16")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--kernels", action="store_true",
                    help="also print every kernel of a replay with its CUDA time")
    args = ap.parse_args()
    defaults = {k: getattr(K, k) for k in KNOBS}
    best: dict[str, tuple[float, str]] = {}
    print(torch.cuda.get_device_name(), "defaults", defaults)
    for model in args.models.split(","):
        shapes = B.MODELS[model]()
        ref = None
        for name in args.variants.split(","):
            for k in KNOBS:
                setattr(K, k, VARIANTS[name].get(k, defaults[k]))
            params = B.make(shapes, torch.float32, seed=3)
            opt = xt.VeLO(params, impl="triton", **B.VELO)
            loss = torch.tensor(1.0, device="cuda")
            opt.step(loss=loss)
            res = ([p.detach().clone() for p in params],
                   [opt.state[p]["m"].clone() for p in params])
            for _ in range(3):
                opt.step(loss=loss)
            torch.cuda.synchronize()
            step_ms = B.timed_steps(opt, loss, args.reps)
            g = opt._triton._graph._graph
            gms = []
            for _ in range(args.reps):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                g.replay()
                b.record()
                torch.cuda.synchronize()
                gms.append(a.elapsed_time(b))
            kms = kernel_ms(g)
            if ref is None:
                ref, dp, dm = res, 0.0, 0.0
            else:
                dp = max(B.rel(a, b) for a, b in zip(res[0], ref[0], strict=True))
                dm = max(B.rel(a, b) for a, b in zip(res[1], ref[1], strict=True))
            gmed = statistics.median(gms)
            if model not in best or gmed < best[model][0]:
                best[model] = (gmed, name)
            print(f"{model} {name:16s} graph {gmed:7.3f} ms  step "
                  f"{statistics.median(step_ms):7.3f} ms  {kms}  vs first: params {dp:.1e} "
                  f"m {dm:.1e}  recordings {opt._triton.graph_recordings}", flush=True)
            if args.kernels:
                every = kernel_ms(g, every=True)
                print(f"    every kernel, ms per replay (total {sum(every.values()):.3f}):")
                for k, v in sorted(every.items(), key=lambda kv: -kv[1]):
                    if v > 0:
                        print(f"      {v:8.4f}  {k}", flush=True)
            del opt, params, res
            torch.cuda.empty_cache()
    for model, (gmed, name) in best.items():  # (shell: eval "$(grep ^ENV: log | cut -c5-)")
        env = " ".join(f"{ENV[k]}={int(v)}" for k, v in VARIANTS[name].items())
        print(f"best {model}: {name} ({gmed:.3f} ms)")
        print(f"ENV: export XOPT_SWEEP_BEST={name} {env}")


if __name__ == "__main__":
    main()
