"""One optimizer step of the learned optimizers on real model shapes, against fused AdamW.

    python bench/lopt_step.py --out bench_lopt.json [--models vit_b16,gpt2_medium]

On one CUDA GPU, for each model's parameter shapes (ViT-B/16: 86.6M parameters; GPT-2
medium: 355M), times ``torch.optim.AdamW(fused=True)``, xopt's plain path and its Triton
path (``precision="exact"`` and ``"fast"``) for small_fc_lopt (PyLO's size: hidden 32, 2
hidden layers) and VeLO, and PyLO's CUDA optimizers where ``pylo`` is importable. Reported
per optimizer: median ms of ``step()`` (CUDA events, after warm-up; AdamW and the Triton
steps timed side by side in interleaved rounds, each optimizer's timed steps after
untimed ones of its own), the ratio to fused AdamW (and to AdamW's fastest round), the GPU's
ms per step back to back and its ratio (AdamW and the Triton steps), the optimizer
state's bytes and the peak extra memory of a step (``max_memory_allocated`` during the
step minus what was allocated before it, plus what the optimizer keeps between steps
beyond its state: tables, caches, and a CUDA graph's private pool, reserved or allocated).
Then it checks the Triton path against plain on the same shapes (one step from the same
state with float64 parameters, so that the step itself is recovered exactly: max relative
error of the step, the parameters and the state, per tensor ``max|a−b| / max|b|``) and
that two runs of the Triton path give the same bits (float32 parameters, two steps).
Prints the device and the date; writes JSON to ``--out``.

``--tiny`` runs a few small tensors on the CPU, the Triton path under Triton's interpreter
(``TRITON_INTERPRET=1``), one step of each kind: a smoke test of this script, whose
timings mean nothing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import xopt.torch as xt  # noqa: E402


def vit_b16() -> list[tuple[int, ...]]:
    """ViT-B/16 (224², 1000 classes): 86,567,656 parameters."""
    d, mlp, layers = 768, 3072, 12
    shapes: list[tuple[int, ...]] = [(d, 3, 16, 16), (d,), (1, 1, d), (1, 197, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (mlp, d), (mlp,),
                   (d, mlp), (d,)]
    shapes += [(d,), (d,), (1000, d), (1000,)]
    return shapes


def gpt2_medium() -> list[tuple[int, ...]]:
    """GPT-2 medium (HF Conv1D layout, tied head): 354,823,168 parameters."""
    d, layers = 1024, 24
    shapes: list[tuple[int, ...]] = [(50257, d), (1024, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d),
                   (4 * d,), (4 * d, d), (d,)]
    shapes += [(d,), (d,)]
    return shapes


def tiny() -> list[tuple[int, ...]]:
    """A few small tensors of ranks 0-3 (``--tiny``)."""
    return [(), (5,), (7, 3), (3, 9), (2, 3, 5)]


MODELS = {"vit_b16": vit_b16, "gpt2_medium": gpt2_medium, "tiny": tiny}
#: where the benchmark runs: "cuda", or "cpu" under ``--tiny``
DEV = "cuda"


def _on_gpu() -> bool:
    return DEV == "cuda"


def sync() -> None:
    if _on_gpu():
        torch.cuda.synchronize()


def empty_cache() -> None:
    if _on_gpu():
        torch.cuda.empty_cache()


def allocated() -> int:
    return torch.cuda.memory_allocated() if _on_gpu() else 0


class Clock:
    """Elapsed ms between :meth:`start` and :meth:`stop`: CUDA events on the GPU (read
    after a synchronization), ``perf_counter`` on the CPU."""

    def __init__(self):
        if _on_gpu():
            self.a = torch.cuda.Event(enable_timing=True)
            self.b = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        if _on_gpu():
            self.a.record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> None:
        if _on_gpu():
            self.b.record()
        else:
            self.t1 = time.perf_counter()

    def ms(self) -> float:
        return self.a.elapsed_time(self.b) if _on_gpu() else (self.t1 - self.t0) * 1e3
SMALL_FC = dict(hidden_size=32, hidden_layers=2, num_training_steps=10_000)
VELO = dict(num_training_steps=10_000)


def make(shapes, dtype=torch.float32, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    params = [torch.nn.Parameter(0.02 * torch.randn(s, device=DEV, generator=g)
                                 .to(torch.float32).to(dtype)) for s in shapes]
    for p in params:
        p.grad = (1e-3 * torch.randn(p.shape, device=DEV, generator=g)).to(dtype)
    return params


def state_bytes(opt) -> int:
    seen, total = set(), 0
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor) and v.device.type == DEV:
                key = (v.untyped_storage().data_ptr(), v.data_ptr(), v.numel())
                if key not in seen:
                    seen.add(key)
                    total += v.numel() * v.element_size()
    return total


def _step(opt, loss) -> None:
    opt.step(loss=loss) if loss is not None else opt.step()


def graph_pool_free_bytes() -> int:
    """Bytes that CUDA graphs' private memory pools hold reserved but not allocated to a
    tensor: a recorded step's intermediates live there between replays, invisible to
    ``memory_allocated`` (what such a pool holds allocated, ``memory_allocated`` counts)."""
    if not _on_gpu():
        return 0
    try:
        snap = torch.cuda.memory_snapshot(include_traces=False)
    except TypeError:  # older torch: no include_traces
        snap = torch.cuda.memory_snapshot()
    return sum(int(seg["total_size"]) - int(seg["allocated_size"]) for seg in snap
               if tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0))


def warm(opt, loss, warmup: int) -> int:
    """``warmup`` steps; returns the bytes the optimizer keeps between steps beyond its
    state (tables, caches, a CUDA graph's pool, allocated or only reserved): part of its
    extra memory, though taken before the timed steps."""
    sync()
    before, state0 = allocated(), state_bytes(opt)
    pool0 = graph_pool_free_bytes()
    for _ in range(warmup):
        _step(opt, loss)
    sync()
    kept = max(0, allocated() - before - (state_bytes(opt) - state0))
    return kept + max(0, graph_pool_free_bytes() - pool0)


def timed_calls(fn, reps: int) -> list[float]:
    """ms of ``reps`` calls of ``fn``, each between two CUDA events and followed by a
    synchronization, so each time includes the host work before the call's first kernel."""
    times = []
    for _ in range(reps):
        c = Clock()
        c.start()
        fn()
        c.stop()
        sync()
        times.append(c.ms())
    return times


def timed_steps(opt, loss, reps: int) -> list[float]:
    """``reps`` steps timed one at a time (:func:`timed_calls`)."""
    return timed_calls(lambda: _step(opt, loss), reps)


def summary(opt, loss, times: list[float], held: int) -> dict:
    """Median/min of ``times``, the state's bytes and the peak extra memory of one more
    step (``max_memory_allocated`` during it minus what was allocated before, plus ``held``)."""
    base = allocated()
    if _on_gpu():
        torch.cuda.reset_peak_memory_stats()
    _step(opt, loss)
    sync()
    peak = torch.cuda.max_memory_allocated() - base if _on_gpu() else 0
    return {"median_ms": statistics.median(times), "min_ms": min(times), "times_ms": times,
            "state_bytes": state_bytes(opt), "held_bytes": held, "peak_extra_bytes": peak + held}


def time_step(opt, loss, warmup: int, reps: int) -> dict:
    """One optimizer timed alone (the plain path, PyLO)."""
    held = warm(opt, loss, warmup)
    return summary(opt, loss, timed_steps(opt, loss, reps), held)


#: steps per back-to-back block (the first step's host work is spread over them; with too
#: few, the back-to-back time is the one-at-a-time time)
B2B_STEPS = 20


def back_to_back(opt, loss, reps: int) -> dict[str, float]:
    """``reps`` steps queued back to back (CUDA events around all of them, one
    synchronization at the end): ``back_to_back_ms``, the GPU's ms per step once the host
    runs ahead of it, as in training, where a step queues behind the backward pass; and
    ``host_ms``, the host's ms per step (``perf_counter`` around the same loop, before
    synchronizing)."""
    sync()
    c = Clock()
    c.start()
    t0 = time.perf_counter()
    for _ in range(reps):
        _step(opt, loss)
    host = (time.perf_counter() - t0) / reps
    c.stop()
    sync()
    return {"back_to_back_ms": c.ms() / reps, "host_ms": host * 1e3}


def time_interleaved(entries: dict, warmup: int, rounds: int, reps: int,
                     settle: int = 3) -> dict:
    """Optimizers (``label -> (opt, loss)``) timed side by side: ``rounds`` rounds, each
    giving every optimizer in turn ``settle`` untimed steps and then ``reps`` timed ones, so
    a drift of the GPU's clocks or of the host over the run reaches every optimizer alike,
    while no timed step directly follows another optimizer's (AdamW timed right after a
    learned-optimizer step, with no settling steps, runs slower than alone, which would
    flatter the ratios). Each result also has ``round_medians_ms`` and ``back_to_back_ms``
    (the median over rounds of :func:`back_to_back`, ``max(reps, B2B_STEPS)`` steps after
    each round's timed ones: a step timed alone includes the host's work before its first
    kernel, about half of fused AdamW's step)."""
    b2b_steps = B2B_STEPS if _on_gpu() else 1  # --tiny: the interpreter is slow
    settle = settle if _on_gpu() else 0
    held = {k: warm(opt, loss, warmup) for k, (opt, loss) in entries.items()}
    times: dict = {k: [] for k in entries}
    medians: dict = {k: [] for k in entries}
    b2b: dict = {k: [] for k in entries}
    for _ in range(rounds):
        for k, (opt, loss) in entries.items():
            for _ in range(settle):
                _step(opt, loss)
            t = timed_steps(opt, loss, reps)
            times[k] += t
            medians[k].append(statistics.median(t))
            b2b[k].append(back_to_back(opt, loss, max(reps, b2b_steps))["back_to_back_ms"])
    out = {}
    for k, (opt, loss) in entries.items():
        out[k] = summary(opt, loss, times[k], held[k])
        out[k]["round_medians_ms"] = medians[k]
        out[k]["back_to_back_ms"] = statistics.median(b2b[k])
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    d = (a.double() - b.double()).abs().max().item()
    return 0.0 if d == 0 else d / max(b.double().abs().max().item(), 1e-300)


def build(method: str, params, impl: str, precision: str = "exact"):
    if method == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, fused=True), None
    loss = torch.tensor(1.0, device=DEV)
    if method == "small_fc_lopt":
        return xt.SmallFCLOpt(params, impl=impl, precision=precision, **SMALL_FC), None
    return xt.VeLO(params, impl=impl, precision=precision, **VELO), loss


def check_exact(method: str, shapes, precision: str) -> dict:
    """Plain vs Triton, one step from the same state, float64 parameters (the step is then
    p_before − p_after exactly); then a second step. Max relative errors over tensors."""
    out = {}
    runs = {}
    for impl in ("plain", "triton"):
        params = make(shapes, torch.float64, seed=1)
        p0 = [p.detach().clone() for p in params]
        opt, loss = build(method, params, impl, precision)
        opt.step(loss=loss) if loss is not None else opt.step()
        steps = [(a - p.detach()) for a, p in zip(p0, params, strict=True)]
        state = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
        runs[impl] = (steps, state, [p.detach().clone() for p in params])
        del opt, params, p0
        empty_cache()
    (sa, sta, pa), (sb, stb, pb) = runs["triton"], runs["plain"]
    out["step_max_rel"] = max(rel(a, b) for a, b in zip(sa, sb, strict=True))
    out["param_max_rel"] = max(rel(a, b) for a, b in zip(pa, pb, strict=True))
    out["state_max_rel"] = max(rel(a[k], b[k]) for a, b in zip(sta, stb, strict=True)
                               for k in b)
    worst = max(range(len(shapes)), key=lambda i: rel(sa[i], sb[i]))
    out["step_worst_tensor"] = list(shapes[worst])
    del runs
    empty_cache()
    return out


def check_bits(method: str, shapes) -> bool:
    """Two runs of the Triton path (float32 parameters, two steps each) give the same bits."""
    results = []
    for _ in range(2):
        params = make(shapes, torch.float32, seed=2)
        opt, loss = build(method, params, "triton")
        for _ in range(2):
            opt.step(loss=loss) if loss is not None else opt.step()
        results.append(([p.detach().clone() for p in params],
                        [{k: v.clone() for k, v in opt.state[p].items()} for p in params]))
        del opt, params
        empty_cache()
    (pa, sa), (pb, sb) = results
    same = all(torch.equal(a, b) for a, b in zip(pa, pb, strict=True))
    same &= all(torch.equal(a[k], b[k]) for a, b in zip(sa, sb, strict=True) for k in a)
    return bool(same)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--models", default="vit_b16,gpt2_medium")
    ap.add_argument("--tiny", action="store_true",
                    help="small tensors on the CPU, the Triton path under Triton's interpreter "
                         "(a smoke test; the timings mean nothing)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10,
                    help="timed steps per optimizer, spread over --rounds")
    ap.add_argument("--rounds", type=int, default=5,
                    help="rounds of the interleaved timing (AdamW and the Triton steps)")
    ap.add_argument("--plain-reps", type=int, default=3)
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--only", default="", help="time (and check) only the optimizers whose "
                    "label contains this (AdamW always runs)")
    ap.add_argument("--profile", action="store_true",
                    help="also print the CUDA kernels of one Triton step (torch.profiler)")
    args = ap.parse_args(argv)
    global DEV
    if args.tiny:
        DEV = "cpu"
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton is first imported
        args.models, args.warmup, args.reps, args.rounds, args.plain_reps = "tiny", 1, 1, 1, 1
    import triton

    dev = torch.cuda.get_device_name() if _on_gpu() else platform.processor() or "cpu"
    date = datetime.date.today().isoformat()
    print(f"{dev}; {date}; torch {torch.__version__}; triton {triton.__version__}")
    report = {"device": dev, "date": date, "torch": torch.__version__,
              "triton": triton.__version__, "models": {}, "notes": []}
    try:
        import pylo  # noqa: F401

        have_pylo = True
    except Exception as e:  # noqa: BLE001
        have_pylo = False
        report["notes"].append(f"PyLO not run: import pylo failed ({type(e).__name__}: {e})")
        print(report["notes"][-1])
    for model in args.models.split(","):
        shapes = MODELS[model]()
        n = sum(int(torch.Size(s).numel()) for s in shapes)
        print(f"\n== {model}: {len(shapes)} tensors, {n / 1e6:.1f}M parameters")
        rows = {}
        timed: set[str] = set()  # the methods --only selected (their checks run below)
        configs = [("adamw", "fused", "exact")]
        precisions = ("exact",) if args.tiny else ("exact", "fast")  # the same on a CPU
        for m in ("small_fc_lopt", "velo"):
            configs += [(m, "triton", p) for p in precisions] + [(m, "plain", "exact")]
        side_by_side = {}  # AdamW and the Triton steps: built together, timed interleaved
        for method, impl, prec in configs:
            label = f"{method}/{impl}" + (f"/{prec}" if impl == "triton" else "")
            if method != "adamw" and args.only not in label:
                continue
            timed.add(method)
            if impl == "plain":  # slow: timed alone, after the others are freed
                continue
            try:
                side_by_side[label] = build(method, make(shapes), impl, prec)
            except torch.cuda.OutOfMemoryError as e:
                rows[label] = {"error": f"out of memory: {e}"}
        reps = max(1, -(-args.reps // args.rounds))
        rows.update(time_interleaved(side_by_side, args.warmup, args.rounds, reps))
        if args.profile and _on_gpu():
            for label, (opt, loss) in side_by_side.items():
                if "/triton" in label:
                    profile(opt, loss, label)
        side_by_side = None
        empty_cache()
        for method, impl, prec in configs:
            label = f"{method}/{impl}"
            if impl != "plain" or args.only not in label:
                continue
            params = make(shapes)
            try:
                opt, loss = build(method, params, impl, prec)
                rows[label] = time_step(opt, loss, 1, args.plain_reps)
            except torch.cuda.OutOfMemoryError as e:
                rows[label] = {"error": f"out of memory: {e}"}
            del params
            opt = None
            empty_cache()
        if have_pylo:
            rows.update(run_pylo(shapes, args))
        base = rows["adamw/fused"]
        adam_state = base["state_bytes"]
        for label, r in rows.items():
            if "median_ms" in r:
                r["ratio_to_adamw"] = r["median_ms"] / base["median_ms"]
                if "round_medians_ms" in base:  # against AdamW's fastest round: a bound
                    r["ratio_to_adamw_best_round"] = (
                        r["median_ms"] / min(base["round_medians_ms"]))
                r["peak_extra_over_adamw_state"] = r["peak_extra_bytes"] / adam_state
                if "back_to_back_ms" in r and "back_to_back_ms" in base:
                    r["back_to_back_ratio"] = r["back_to_back_ms"] / base["back_to_back_ms"]
                print(f"{label:32s} {r['median_ms']:9.3f} ms  x{r['ratio_to_adamw']:6.2f}  "
                      f"state {r['state_bytes'] / 2**20:8.1f} MiB  peak extra "
                      f"{r['peak_extra_bytes'] / 2**20:8.1f} MiB "
                      f"({r['peak_extra_over_adamw_state']:.2f}x AdamW state)"
                      + (f"  x{r['ratio_to_adamw_best_round']:.2f} AdamW's fastest round"
                         if "ratio_to_adamw_best_round" in r else "")
                      + (f"  rounds {[round(t, 3) for t in r['round_medians_ms']]}"
                         if "round_medians_ms" in r else "")
                      + (f"  back to back {r['back_to_back_ms']:.3f} ms "
                         f"(x{r['back_to_back_ratio']:.2f})" if "back_to_back_ratio" in r
                         else ""))
            else:
                print(f"{label:32s} {r}")
        checks = {}
        if not args.skip_checks:
            for method in (m for m in ("small_fc_lopt", "velo") if m in timed):
                for prec in precisions:
                    checks[f"{method}/{prec}"] = c = check_exact(method, shapes, prec)
                    print(f"{method}/{prec} vs plain: step max rel {c['step_max_rel']:.2e} "
                          f"(worst {c['step_worst_tensor']}), params {c['param_max_rel']:.2e}, "
                          f"state {c['state_max_rel']:.2e}")
                checks[f"{method}/bitwise_two_runs"] = b = check_bits(method, shapes)
                print(f"{method}: two runs identical bits: {b}")
        report["models"][model] = {"tensors": len(shapes), "params": n, "timings": rows,
                                   "checks": checks}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
        print(f"\nwrote {args.out}")
    return 0


def profile(opt, loss, label: str) -> None:
    """Per-kernel CUDA time of two steps, and the host time of one step."""
    import time

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    opt.step(loss=loss) if loss is not None else opt.step()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(2):
            opt.step(loss=loss) if loss is not None else opt.step()
        torch.cuda.synchronize()
    print(f"-- {label}: host time of one step (no sync) {host * 1e3:.2f} ms")
    print(p.key_averages().table(sort_by="self_cuda_time_total", row_limit=14,
                                 max_name_column_width=40))
    import cProfile
    import pstats

    torch.cuda.synchronize()
    cp = cProfile.Profile()
    cp.enable()
    opt.step(loss=loss) if loss is not None else opt.step()
    cp.disable()
    torch.cuda.synchronize()
    print(f"-- {label}: host functions of one step (cProfile, by own time)")
    pstats.Stats(cp).sort_stats("tottime").print_stats(12)


def run_pylo(shapes, args) -> dict:
    """PyLO's CUDA optimizers, if installed (pylo.optim.VeLO_CUDA / AdafacLO_CUDA)."""
    rows = {}
    try:
        import pylo.optim as po
    except Exception as e:  # noqa: BLE001
        return {"pylo": {"error": f"{type(e).__name__}: {e}"}}
    for label, name in (("pylo/small_fc_lopt_cuda", "AdafacLO_CUDA"), ("pylo/velo_cuda",
                                                                        "VeLO_CUDA")):
        cls = getattr(po, name, None)
        if cls is None:
            rows[label] = {"error": f"pylo.optim has no {name}"}
            continue
        params = make(shapes)
        try:
            opt = cls(params)
            loss = torch.tensor(1.0, device=DEV)

            class _Wrap:
                def __init__(self, opt, takes_loss):
                    self.opt, self.takes_loss, self.state = opt, takes_loss, opt.state

                def step(self, loss=None):
                    return self.opt.step(loss=loss) if self.takes_loss else self.opt.step()

            rows[label] = time_step(_Wrap(opt, "velo" in label), loss, args.warmup,
                                    args.reps)
        except Exception as e:  # noqa: BLE001
            rows[label] = {"error": f"{type(e).__name__}: {e}"}
        del params
        empty_cache()
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
