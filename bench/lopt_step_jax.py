"""xopt.jax's learned optimizers on real model shapes, side by side with optax.adamw and the
torch Triton path, and the jit compile time of every xopt.jax transform.

    python bench/lopt_step_jax.py --out-dir $OUT [--models vit_b16,gpt2_medium]
    python bench/lopt_step_jax.py --tiny --out-dir /tmp/x     (CPU, seconds; CI runs it)

One process, in this order, each phase under a shared deadline (``--deadline-s``: what does
not fit is skipped with a note, and the JSON is rewritten after every phase, so a run cut
short still leaves its results):

1. timing, per model (ViT-B/16's 152 tensors, GPT-2 medium's 292; bench/lopt_step.py's
   shapes and configurations: small_fc_lopt at PyLO's size, hidden 32, 2 hidden layers),
   side by side in interleaved rounds: optax.adamw and every fast JAX path (with
   ``--plain``, the plain path too) as ``jax.jit``
   of ``update`` + ``optax.apply_updates`` with parameters and state donated (ms per call:
   the wall time of one call and its ``block_until_ready``, and apart the time until the
   call returned, its host part; the first call's ``lower`` and ``compile`` seconds),
   torch's fused AdamW and the torch Triton path (the same wall-time
   measure, ``torch.cuda.synchronize`` after each step; its "compile" is its first step);
   small_fc_lopt's entries in one group, VeLO's in another (memory), optax.adamw in both,
   and each entry's ratio taken to the optax.adamw of its own group's rounds;
2. the golden parity cases (the bundled ones) through ``xopt.parity`` with each fast JAX
   path in exact mode, on this device;
3. checks, per model, on its distinct shapes (one tensor per shape, plus a second copy of
   one matrix, so that a group holds more than one tensor): every fast JAX path against
   the plain path, two steps from the same state, max relative error (``max|a−b| /
   max|b|`` per tensor, worst over tensors) of the step, the parameters and every state
   array; and the parameters and state against the torch Triton path from the same inputs;
4. the compile time on GPT-2 medium's shapes (abstract: nothing is allocated) of every
   xopt.jax transform that takes a plain parameter pytree, against optax.adamw's (those
   measured in 1. are not compiled again; the plain learned optimizers only with
   ``--plain``: they took minutes).

Prints a short table per model (ms, ratio to optax.adamw, the call's return ms, compile s)
and writes
``lopt_step_jax.json`` under ``--out-dir``.

``--breakdown MODEL`` first takes the Pallas update apart on MODEL's shapes, per path of
``--breakdown-paths``: the inner update runs with a stage runner
(:func:`xopt.jax._lopt_fast.run_stage`) that compiles each stage alone and times it on its
real inputs: ``setup``, ``pack`` (the shape groups stacked), per kernel group ``prep``
(XLA: Adafactor statistics, factors), ``stats`` (Pallas), ``norm`` (XLA: normalizers, axis
terms, weights), ``fused`` (Pallas), per other group ``xla`` (the packed path), VeLO's
``lstm``, and ``unpack`` (each tensor's rows sliced out); per stage the median ms, the bytes
of its array arguments and results (what it must read and write at least) as GB/s, and the
launches of its compiled program (ENTRY instructions that run something). Beside them: the
sum of the stages, the inner update as one jit, the whole step (update + apply_updates)
and optax.adamw's, the staged result against the one-jit result, each Pallas kernel's
calls, summed grid and Triton IR size (lowered for CUDA, what bounds its compile time),
and on CUDA the torch Triton path's kernels per step (torch.profiler, CUDA graphs off).
``--breakdown-only`` stops there.

Two other modes, each instead of the phases above:

* ``--diagnose`` (about a minute on a GPU; ``--deadline-s`` 90 by default): each Pallas
  kernel against the plain path's math on a few shapes (ragged ones, whose last blocks
  reach past the tensor), one shape group of two tensors at a time: the statistics kernel's
  normalizer statistic (``feature_sq_mean``) and the fused kernel's step, ``m`` and ``rms``
  against the spec's function under ``vmap``, max abs diff and relative diff, and whether
  any output holds NaN/inf; then the whole jitted update (``impl="pallas"`` against
  ``"plain"``) on a small model of those shapes;
* ``--op-counts 8,32,128``: the ops and compiled kernels of every transform's jitted
  update as the tensor count grows (any backend). Options that are unavailable here (no CUDA for
torch, no Triton, a path that fails to build) give a note, not a crash.
"""

from __future__ import annotations

import os

# JAX must not take the whole GPU: torch runs in the same process
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")

import argparse  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import xopt.jax as xj  # noqa: E402

#: small_fc_lopt and VeLO as bench/lopt_step.py configures them (PyLO's small_fc size)
SMALL_FC = dict(hidden_size=32, hidden_layers=2, num_training_steps=10_000)
VELO = dict(num_training_steps=10_000)


def vit_b16() -> list[tuple[int, ...]]:
    """ViT-B/16 (224², 1000 classes): 86,567,656 parameters (as bench/lopt_step.py)."""
    d, mlp, layers = 768, 3072, 12
    shapes: list[tuple[int, ...]] = [(d, 3, 16, 16), (d,), (1, 1, d), (1, 197, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (mlp, d), (mlp,),
                   (d, mlp), (d,)]
    return shapes + [(d,), (d,), (1000, d), (1000,)]


def gpt2_medium(layers: int = 24) -> list[tuple[int, ...]]:
    """GPT-2 medium (HF Conv1D layout, tied head): 354,823,168 parameters."""
    d = 1024
    shapes: list[tuple[int, ...]] = [(50257, d), (1024, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d),
                   (4 * d,), (4 * d, d), (d,)]
    return shapes + [(d,), (d,)]


def tiny_model() -> list[tuple[int, ...]]:
    """Two blocks of width 8 (CI's --tiny: every kind of group, kept small for the CPU)."""
    d = 8
    return [(1, 5, d)] + [(d,), (3 * d, d), (d, 3 * d)] * 2 + [()]


def tiny_pair() -> list[tuple[int, ...]]:
    """Two groups of two tensors, one for the kernels and one for XLA (the CPU test of
    ``--breakdown``: each stage is compiled alone, so fewer groups keep it short)."""
    return [(8,), (24, 8), (8,), (24, 8)]


MODELS = {"vit_b16": vit_b16, "gpt2_medium": gpt2_medium, "tiny": tiny_model,
          "tiny_pair": tiny_pair,
          # twice GPT-2 medium's blocks (580 tensors): how compile time grows with tensors
          "gpt2_medium_x2": functools.partial(gpt2_medium, 48)}

#: --compiler-option: XLA options of every jitted step (``jax.jit(compiler_options=...)``)
COMPILER_OPTIONS: dict = {}

#: the JAX paths timed: label -> (method, impl, precision)
JAX_PATHS = {
    "small_fc_lopt": [("jax/small_fc_lopt/packed", "packed", "exact"),
                      ("jax/small_fc_lopt/pallas/exact", "pallas", "exact"),
                      ("jax/small_fc_lopt/pallas/fast", "pallas", "fast")],
    "velo": [("jax/velo/packed", "packed", "exact"),
             ("jax/velo/pallas", "pallas", "exact")],
    # small_fc_lopt's kernels on μLO's clipped gradients (torch's μLO has no Triton path)
    "mulo": [("jax/mulo/pallas/exact", "pallas", "exact")],
}
#: the methods with a torch Triton path to time and check beside the JAX ones
TORCH_TRITON = ("small_fc_lopt", "velo")


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def note(report: dict, text: str) -> None:
    report["notes"].append(text)
    print(f"note: {text}", flush=True)


def err(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


# -- JAX entries ------------------------------------------------------------------------------


def make_tx(method: str, impl: str | None, precision: str = "exact", meta_params=None):
    if method == "adamw":
        return optax.adamw(1e-3)
    cfg = VELO if method == "velo" else SMALL_FC
    return getattr(xj, method)(meta_params, impl=impl, precision=precision, **cfg)


def jax_params(shapes, seed: int, scale: float = 0.02) -> list:
    rng = np.random.default_rng(seed)
    return [jnp.asarray((scale * rng.standard_normal(s)).astype(np.float32)) for s in shapes]


def device_params(shapes, seed: int, scale: float) -> list:
    """Random float32 arrays made on the device (fast for 355M parameters)."""
    keys = jax.random.split(jax.random.PRNGKey(seed), max(len(shapes), 1))
    return [scale * jax.random.normal(k, s, jnp.float32)
            for k, s in zip(keys[:len(shapes)], shapes, strict=True)]


def _step_body(tx, method: str):
    def step(params, state, grads, loss):
        if method == "adamw":
            updates, state = tx.update(grads, state, params)
        else:
            updates, state = tx.update(grads, state, params, value=loss)
        return optax.apply_updates(params, updates), state

    return step


def step_fn(tx, method: str, donate: bool = True):
    return jax.jit(_step_body(tx, method), donate_argnums=(0, 1) if donate else (),
                   compiler_options=COMPILER_OPTIONS or None)


class JaxEntry:
    """One JAX optimizer on one model: its own parameters and state (donated each call)."""

    def __init__(self, method: str, impl: str | None, precision: str, shapes, grads,
                 loss) -> None:
        self.method = method
        self.tx = make_tx(method, impl, precision)
        self.params = device_params(shapes, 0, 0.02)
        self.state = self.tx.init(self.params)
        self.grads, self.loss = grads, loss
        fn = step_fn(self.tx, method)
        t0 = time.perf_counter()
        lowered = fn.lower(self.params, self.state, grads, loss)
        t1 = time.perf_counter()
        self.compiled = lowered.compile()
        t2 = time.perf_counter()
        self.lower_s, self.compile_s = t1 - t0, t2 - t1
        self.call()
        jax.block_until_ready(self.params)

    def call(self) -> None:
        self.params, self.state = self.compiled(self.params, self.state, self.grads, self.loss)

    def timed(self) -> float:
        t0 = time.perf_counter()
        self.call()
        self.dispatch_ms = (time.perf_counter() - t0) * 1e3  # the call's host time
        jax.block_until_ready((self.params, self.state))
        return (time.perf_counter() - t0) * 1e3

    def free(self) -> None:
        self.params = self.state = self.compiled = None


# -- torch entries -----------------------------------------------------------------------------


class TorchEntry:
    def __init__(self, method: str, impl: str, precision: str, shapes) -> None:
        import lopt_step as L
        import torch

        self.torch = torch
        self.params = L.make(shapes)
        self.opt, self.loss = L.build(method, self.params, impl, precision)
        t0 = time.perf_counter()
        self.call()
        torch.cuda.synchronize()
        self.compile_s = time.perf_counter() - t0  # first step: Triton's compiles, graphs
        self.lower_s = 0.0

    def call(self) -> None:
        if self.loss is not None:
            self.opt.step(loss=self.loss)
        else:
            self.opt.step()

    def timed(self) -> float:
        t0 = time.perf_counter()
        self.call()
        self.dispatch_ms = (time.perf_counter() - t0) * 1e3
        self.torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3

    def free(self) -> None:
        self.opt = self.params = None
        self.torch.cuda.empty_cache()


def torch_cuda() -> str | None:
    """Why the torch Triton path cannot run here (None: it can)."""
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        return f"torch not importable ({err(e)})"
    if not torch.cuda.is_available():
        return "no CUDA device for torch"
    try:
        import triton  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"triton not importable ({err(e)})"
    return None


def time_side_by_side(entries: dict, rounds: int, reps: int, settle: int = 2) -> dict:
    """ms per call of each entry, in ``rounds`` interleaved rounds (``settle`` untimed calls
    before each entry's ``reps`` timed ones); an entry that fails is dropped with its
    error."""
    times: dict = {k: [] for k in entries}
    # how long each call took to return, before the wait for the device: the host's part
    dispatch: dict = {k: [] for k in entries}
    failed: dict = {}
    for _ in range(rounds):
        for k, e in entries.items():
            if k in failed:
                continue
            try:
                for _ in range(settle):
                    e.timed()
                for _ in range(reps):
                    times[k].append(e.timed())
                    dispatch[k].append(e.dispatch_ms)
            except Exception as ex:  # noqa: BLE001
                failed[k] = {"error": err(ex)}
    out = {k: {"median_ms": statistics.median(v), "min_ms": min(v), "times_ms": v,
               "dispatch_median_ms": statistics.median(dispatch[k]),
               "lower_s": entries[k].lower_s, "compile_s": entries[k].compile_s}
           for k, v in times.items() if k not in failed and v}
    out.update(failed)
    return out


# -- checks ------------------------------------------------------------------------------------


def check_shapes(shapes) -> list[tuple[int, ...]]:
    """One tensor per distinct shape, plus a second copy of the first factored matrix."""
    out = list(dict.fromkeys(tuple(s) for s in shapes))
    extra = next((s for s in out if len(s) == 2 and min(s) > 1), None)
    return out + ([extra] if extra else [])


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.size == 0:
        return 0.0
    d = np.abs(a - b).max()
    return 0.0 if d == 0 else float(d / max(np.abs(b).max(), 1e-300))


def run_jax_steps(method, impl, precision, shapes, steps=2, meta_params=None):
    """Two steps of one JAX path from fixed inputs: per step the updates, then the final
    parameters and state (NumPy leaves, and the state itself)."""
    tx = make_tx(method, impl, precision, meta_params)
    params = jax_params(shapes, 1)
    state = tx.init(params)

    @jax.jit
    def one(p, s, g, l):
        u, s = tx.update(g, s, p, value=l)
        return u, optax.apply_updates(p, u), s

    out = []
    for t in range(steps):
        u, params, state = one(params, state, jax_params(shapes, 100 + t, 1e-3),
                               jnp.float32(2.0 - 0.1 * t))
        out.append([np.asarray(x) for x in u])
    return out, [np.asarray(p) for p in params], jax.tree.leaves(state), state


def torch_state_like_jax(method, shapes, steps=2):
    """The torch Triton path from the same inputs: final parameters and per-tensor state
    (m, rms, v_row, v_col, v_diag) as NumPy."""
    import lopt_step as L
    import torch

    params = [torch.nn.Parameter(torch.from_numpy(np.asarray(p)).cuda())
              for p in jax_params(shapes, 1)]
    opt, loss = L.build(method, params, "triton", "exact")
    for t in range(steps):
        for p, g in zip(params, jax_params(shapes, 100 + t, 1e-3), strict=True):
            p.grad = torch.from_numpy(np.asarray(g)).cuda()
        opt.step(loss=torch.tensor(2.0 - 0.1 * t, device="cuda"))
    return ([p.detach().cpu().numpy() for p in params],
            [{k: v.detach().cpu().numpy() for k, v in opt.state[p].items()} for p in params])


def checks(model: str, shapes, report: dict, dl: Deadline, with_torch: bool) -> dict:
    shapes = check_shapes(shapes)
    out: dict = {"shapes": [list(s) for s in shapes]}
    for method, paths in JAX_PATHS.items():
        if dl.left() < 30:
            note(report, f"{model}: checks of {method} skipped (deadline)")
            continue
        try:
            ref_steps, ref_p, ref_s, _ = run_jax_steps(method, "plain", "exact", shapes)
        except Exception as e:  # noqa: BLE001
            note(report, f"{model}: {method} plain failed: {err(e)}")
            continue
        tstate = None
        if with_torch and method in TORCH_TRITON:
            try:
                tstate = torch_state_like_jax(method, shapes)
            except Exception as e:  # noqa: BLE001
                note(report, f"{model}: {method} torch Triton check failed: {err(e)}")
        for label, impl, prec in paths:
            try:
                steps, p, s, state = run_jax_steps(method, impl, prec, shapes)
            except Exception as e:  # noqa: BLE001
                out[label] = {"error": err(e)}
                note(report, f"{model}: {label} check failed: {err(e)}")
                continue
            c = {"step_max_rel": max(rel(a, b) for st, rt in zip(steps, ref_steps, strict=True)
                                     for a, b in zip(st, rt, strict=True)),
                 "param_max_rel": max(rel(a, b) for a, b in zip(p, ref_p, strict=True)),
                 "state_max_rel": max(rel(a, b) for a, b in zip(s, ref_s, strict=True))}
            if tstate is not None:
                tp, ts = tstate
                c["param_max_rel_vs_torch_triton"] = max(
                    rel(a, b) for a, b in zip(p, tp, strict=True))
                inner = state.inner
                c["state_max_rel_vs_torch_triton"] = max(
                    rel(jax.tree.leaves(getattr(inner, v))[i], ts[i][v])
                    for v in ("m", "rms", "v_row", "v_col", "v_diag") for i in range(len(tp)))
            out[label] = c
            print(f"  check {label:34s} vs plain: step {c['step_max_rel']:.2e}, params "
                  f"{c['param_max_rel']:.2e}, state {c['state_max_rel']:.2e}"
                  + (f"; vs torch Triton: params {c['param_max_rel_vs_torch_triton']:.2e}, "
                     f"state {c['state_max_rel_vs_torch_triton']:.2e}"
                     if "param_max_rel_vs_torch_triton" in c else ""), flush=True)
    return out


# -- the phases --------------------------------------------------------------------------------


def wanted(args, label: str) -> bool:
    """``--only``: the label contains one of its comma-separated strings (or it is empty)."""
    return not args.only or any(w and w in label for w in args.only.split(","))


def bench_model(model: str, args, report: dict, dl: Deadline) -> None:
    shapes = MODELS[model]()
    n = int(sum(int(np.prod(s)) for s in shapes))
    print(f"\n== {model}: {len(shapes)} tensors, {n / 1e6:.1f}M parameters, "
          f"{len(set(shapes))} shapes", flush=True)
    res = report["models"].setdefault(model, {"tensors": len(shapes), "params": n,
                                              "timings": {}, "checks": {}})
    why_torch = torch_cuda()
    if why_torch is not None:
        note(report, f"torch Triton path not run: {why_torch}")
    grads = device_params(shapes, 7, 1e-3)
    loss = jnp.float32(1.0)
    compile_times = report.setdefault("compile", {}).setdefault(model, {})
    adamw = None
    try:
        adamw = JaxEntry("adamw", None, "exact", shapes, grads, loss)
        compile_times["optax.adamw"] = {"lower_s": adamw.lower_s, "compile_s": adamw.compile_s,
                                        "total_s": adamw.lower_s + adamw.compile_s,
                                        **program_counts(adamw.compiled.as_text())}
        print(f"  built jax/optax.adamw: lower {adamw.lower_s:.1f} s, compile "
              f"{adamw.compile_s:.1f} s", flush=True)
    except Exception as e:  # noqa: BLE001
        note(report, f"{model}: optax.adamw failed: {err(e)}")
    torch_adamw = None
    if why_torch is None:
        try:
            torch_adamw = TorchEntry("adamw", "fused", "exact", shapes)
        except Exception as e:  # noqa: BLE001
            note(report, f"{model}: torch fused AdamW failed: {err(e)}")
    for method in JAX_PATHS:
        # --plain: the plain path timed in the same rounds as the others
        paths = JAX_PATHS[method] + ([(f"jax/{method}/plain", "plain", "exact")]
                                     if args.plain else [])
        if args.only and not any(wanted(args, label) for label, _, _ in paths):
            continue
        if dl.left() < 45:
            note(report, f"{model}: timing of {method} skipped (deadline)")
            continue
        entries: dict = {}
        if adamw is not None:
            entries["jax/optax.adamw"] = adamw
        for label, impl, prec in paths:
            if not wanted(args, label):
                continue
            if dl.left() < 40:
                note(report, f"{model}: {label} skipped (deadline)")
                continue
            try:
                entries[label] = e = JaxEntry(method, impl, prec, shapes, grads, loss)
                compile_times[f"xopt.jax.{method}/{impl}/{prec}"] = {
                    "lower_s": e.lower_s, "compile_s": e.compile_s,
                    "total_s": e.lower_s + e.compile_s, **program_counts(e.compiled.as_text())}
                print(f"  built {label}: lower {e.lower_s:.1f} s, compile {e.compile_s:.1f} s "
                      f"[{compile_times[f'xopt.jax.{method}/{impl}/{prec}']['fusions']} "
                      "fusions]", flush=True)
            except Exception as e:  # noqa: BLE001
                res["timings"][label] = {"error": err(e)}
                note(report, f"{model}: {label} failed: {err(e)}")
                traceback.print_exc(limit=3)
        if torch_adamw is not None and method in TORCH_TRITON:
            entries["torch/adamw_fused"] = torch_adamw
            label = f"torch/{method}/triton/exact"
            try:
                entries[label] = TorchEntry(method, "triton", "exact", shapes)
            except Exception as e:  # noqa: BLE001
                res["timings"][label] = {"error": err(e)}
                note(report, f"{model}: {label} failed: {err(e)}")
        try:
            timed = time_side_by_side(entries, args.rounds, args.reps)
        except Exception as e:  # noqa: BLE001
            note(report, f"{model}: timing {method} failed: {err(e)}")
            timed = {}
        # every ratio against the optax.adamw timed in the same rounds (its own time moved by
        # up to 40% between two groups' rounds of one run); AdamW is timed with each group:
        # both kept
        base = timed.get("jax/optax.adamw", {}).get("median_ms")
        base_key = "jax/optax.adamw" if "jax/optax.adamw" not in res["timings"] \
            else f"jax/optax.adamw@{method}"
        for k in timed:
            key = k if k not in res["timings"] else f"{k}@{method}"
            if base and "median_ms" in timed[k]:
                timed[k]["ratio_to_optax_adamw"] = timed[k]["median_ms"] / base
                timed[k]["optax_adamw_entry"] = base_key
            res["timings"][key] = timed[k]
        for k, e in entries.items():
            if "adamw" not in k:
                e.free()
        entries.clear()
        write(report, args)
    for e in (adamw, torch_adamw):
        if e is not None:
            e.free()
    del grads
    table(model, res)
    write(report, args)


def check_model(model: str, args, report: dict, dl: Deadline) -> None:
    res = report["models"].setdefault(model, {"timings": {}})
    if dl.left() > 60:
        print(f"\n== checks on {model}'s shapes", flush=True)
        res["checks"] = checks(model, MODELS[model](), report, dl, torch_cuda() is None)
    else:
        note(report, f"{model}: checks skipped (deadline)")
    write(report, args)


def table(model: str, res: dict) -> None:
    t = res["timings"]
    print(f"\n{model}: ms per step (median), ratio to the optax.adamw timed in the same "
          "rounds (named after @ when not the first), ms until the call returned (median: "
          "the host's part), compile s (lower + compile)")
    for k, r in t.items():
        if "median_ms" not in r:
            print(f"  {k:40s} {r.get('error', r)}")
            continue
        ratio = f"x{r['ratio_to_optax_adamw']:6.2f}" if "ratio_to_optax_adamw" in r \
            else "   -   "
        of = r.get("optax_adamw_entry", "")
        print(f"  {k:40s} {r['median_ms']:9.3f} ms  {ratio}  returns "
              f"{r['dispatch_median_ms']:8.3f} ms  compile {r['lower_s'] + r['compile_s']:7.1f} s"
              + (f"  (vs {of})" if "@" in of else ""), flush=True)


def golden(report: dict, dl: Deadline) -> None:
    """The bundled golden cases with each fast JAX path (xopt.parity, this device)."""
    import functools
    import importlib

    # (the package attributes xopt.jax.small_fc_lopt / velo are the functions)
    sfc_mod = importlib.import_module("xopt.jax.small_fc_lopt")
    velo_mod = importlib.import_module("xopt.jax.velo")
    from xopt.parity import bundled_traces
    from xopt.parity.harness import run_parity

    out = report.setdefault("golden", {})
    for method, mod, fn_name in (("small_fc_lopt", sfc_mod, "small_fc_lopt"),
                                 ("velo", velo_mod, "velo")):
        original = getattr(mod, fn_name)
        for label, impl, prec in JAX_PATHS[method]:
            if prec == "fast":  # TF32: not held to the golden bounds (nor is torch's)
                continue
            if dl.left() < 40:
                note(report, f"golden {label} skipped (deadline)")
                continue
            setattr(mod, fn_name, functools.partial(original, impl=impl, precision=prec))
            try:
                rep = run_parity(method, bundled_traces(method), backends=["jax"],
                                 explicit_backends=True)
                out[label] = {"verdict": rep.verdict,
                              "max_rel": {f"{r.trace}/{r.mode}": r.max_rel_error
                                          for r in rep.runs}}
                print(f"  golden {label}: {rep.verdict} "
                      f"{ {k: f'{v:.2e}' for k, v in out[label]['max_rel'].items()} }",
                      flush=True)
            except Exception as e:  # noqa: BLE001
                out[label] = {"error": err(e)}
                note(report, f"golden {label} failed: {err(e)}")
            finally:
                setattr(mod, fn_name, original)


def survey_transforms(with_plain: bool, rank: int) -> list[tuple[str, object]]:
    from xopt import specs

    out: list = [("optax.adamw", lambda: optax.adamw(1e-3)),
                 ("xopt.jax.adamw", lambda: xj.adamw(1e-3))]
    for label, impl, prec in JAX_PATHS["small_fc_lopt"] + JAX_PATHS["velo"]:
        m = label.split("/")[1]
        out.append((f"xopt.jax.{m}/{impl}/{prec}",
                    lambda m=m, impl=impl, prec=prec: make_tx(m, impl, prec)))
    # μLO: small_fc_lopt's network (its default impl: the kernels on a GPU), every leaf a
    # hidden layer (μP's multipliers change values, not the program)
    out.append(("xopt.jax.mulo", lambda: xj.mulo(**SMALL_FC)))
    for method in ("galore", "flora", "coap", "plumage"):
        extra = {"beta1": 0.9} if method == "flora" else {}

        def build(method=method, extra=extra):
            hp = specs.get(method).make(None, lr=1e-3, rank=rank, **extra)
            return getattr(xj, method)(spec=hp)

        out.append((f"xopt.jax.{method}", build))
    if with_plain:
        out += [("xopt.jax.small_fc_lopt/plain", lambda: make_tx("small_fc_lopt", "plain")),
                ("xopt.jax.velo/plain", lambda: make_tx("velo", "plain"))]
    return out


def compile_survey(model: str, report: dict, dl: Deadline, args) -> None:
    """``lower`` + ``compile`` seconds of ``update`` + ``apply_updates`` on abstract arrays."""
    shapes = MODELS[model]()
    params = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    loss = jax.ShapeDtypeStruct((), jnp.float32)
    out = report.setdefault("compile", {}).setdefault(model, {})
    print(f"\n== compile time of update + apply_updates, {model} shapes ({len(shapes)} tensors)",
          flush=True)
    rank = 2 if model == "tiny" else 128
    for label, build in survey_transforms(args.plain, rank):
        if args.survey and not any(x in label for x in args.survey.split(",")):
            continue
        if label in out and "total_s" in out[label]:  # measured in the timing phase
            print(f"  {label:40s} total {out[label]['total_s']:6.1f} s (timing phase)")
            continue
        if dl.left() < 20:
            note(report, f"compile survey: {label} skipped (deadline)")
            continue
        try:
            tx = build()
            state = jax.eval_shape(tx.init, params)
            lopt = any(m in label for m in ("small_fc_lopt", "velo", "mulo"))
            fn = step_fn(tx, "lopt" if lopt else "adamw", donate=False)
            t0 = time.perf_counter()
            lowered = fn.lower(params, state, params, loss)
            t1 = time.perf_counter()
            compiled = lowered.compile()
            t2 = time.perf_counter()
            out[label] = {"lower_s": t1 - t0, "compile_s": t2 - t1, "total_s": t2 - t0,
                          **program_counts(compiled.as_text())}
        except Exception as e:  # noqa: BLE001
            out[label] = {"error": err(e)}
            note(report, f"compile survey {label}: {err(e)}")
            continue
        write(report, args)  # (a compile cut short by the run's time limit loses nothing)
        base = out.get("optax.adamw", {}).get("total_s")
        ratio = f"x{out[label]['total_s'] / base:5.2f} optax.adamw" if base else ""
        c = out[label]
        print(f"  {label:40s} lower {t1 - t0:6.1f} s  compile {t2 - t1:6.1f} s  {ratio}  "
              f"[{c['fusions']} fusions, {c['triton_gemms']} Triton GEMMs, {c['blas']} BLAS, "
              f"{c['conditionals']} conditionals]", flush=True)


def program_counts(hlo_text: str) -> dict:
    """What a compiled program holds (any backend): fusions, the Triton GEMM fusions among
    them (XLA:GPU autotunes and compiles each distinct one), BLAS calls and conditionals."""
    return {"fusions": hlo_text.count(" fusion("),
            "triton_gemms": hlo_text.count('"kind":"__triton_nested_gemm_fusion"')
            + hlo_text.count('"kind":"__triton_gemm"'),
            "blas": len(re.findall(r'custom_call_target="__cublas', hlo_text)),
            "conditionals": hlo_text.count(" conditional(")}


#: --op-counts: every xopt.jax transform that takes a plain parameter pytree, and optax.adamw
#: (label -> builder); the learned optimizers at the sizes of :data:`SMALL_FC`, :data:`VELO`
OP_COUNT_SHAPES = [(16, 12), (12,), (12, 16), (8, 16)]  # a block, repeated


def op_count_transforms() -> list[tuple[str, object]]:
    out: list = [("optax.adamw", lambda: optax.adamw(1e-3)),
                 ("xopt.jax.adamw", lambda: xj.adamw(1e-3))]
    # μLO: small_fc_lopt's network (its default impl: the kernels on a GPU), every leaf a
    # hidden layer (μP's multipliers change values, not the program)
    out.append(("xopt.jax.mulo", lambda: xj.mulo(**SMALL_FC)))
    for method in ("galore", "flora", "coap", "plumage"):
        extra = {"beta1": 0.9} if method == "flora" else {}
        out.append((f"xopt.jax.{method}",
                    lambda method=method, extra=extra: getattr(xj, method)(
                        1e-3, rank=2, **extra)))
    out.append(("xopt.jax.mulo", lambda: xj.mulo(num_training_steps=100)))
    for method in ("small_fc_lopt", "velo"):
        for impl in ("plain", "packed", "pallas"):
            out.append((f"xopt.jax.{method}/{impl}",
                        lambda method=method, impl=impl: make_tx(method, impl)))
    return out


def _hlo_bytes(shape: str) -> int:
    """Bytes of an HLO result shape (``f32[8,3]{1,0}``, or a tuple of such)."""
    import re

    return sum(int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64))
               * int(bits) // 8 for bits, dims in re.findall(r"[a-z]+(\d+)\[([\d,]*)\]", shape))


def op_counts(tx, n: int, compile_: bool = True) -> dict:
    """The jitted ``update`` + ``apply_updates`` on ``n`` tensors (``OP_COUNT_SHAPES``
    repeated; abstract arrays, nothing allocated): StableHLO ops of the lowered program
    (``ops``: every op; ``compute``: those but the ones that only move data: slices,
    concatenations, reshapes, broadcasts, converts, constants, tuples, returns), and of the
    compiled program (this backend's) the instructions of the entry computation that run
    as kernels (``kernels``: fusions, custom calls and unfused ops, not parameters, tuples,
    bitcasts, constants), the bytes written by its unfused copies and concatenations
    (``copied_mb``: what stacking and unstacking cost where XLA did not fuse them into their
    consumers and producers) and its temporary bytes (``temp_mb``); parameters and state
    donated, as a training step would."""
    import re
    from collections import Counter

    shapes = (OP_COUNT_SHAPES * (n // len(OP_COUNT_SHAPES) + 1))[:n]
    params = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    loss = jax.ShapeDtypeStruct((), jnp.float32)
    state = jax.eval_shape(tx.init, params)

    def step(p, s, g, v):
        u, s = tx.update(g, s, p, value=v)
        return optax.apply_updates(p, u), s

    lowered = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, params, loss)
    ops = Counter(re.findall(r"= (?:\"?)(stablehlo\.[a-z_]+)", lowered.as_text()))
    moves = ("slice", "concatenate", "reshape", "broadcast_in_dim", "convert", "constant",
             "tuple", "get_tuple_element", "iota", "transpose", "dynamic_slice",
             "dynamic_update_slice", "bitcast_convert", "gather")
    out = {"ops": sum(ops.values()),
           "compute": sum(v for k, v in ops.items() if k.split(".")[1] not in moves)}
    if compile_:
        compiled = lowered.compile()
        text = compiled.as_text()
        entry = text[text.index("ENTRY"):]
        entry = entry[:entry.index("\n}")]
        kinds = Counter(re.findall(r"= \S+ ([a-z\-]+)\(", entry))
        idle = ("parameter", "tuple", "get-tuple-element", "bitcast", "constant")
        out["kernels"] = sum(v for k, v in kinds.items() if k not in idle)
        copied = sum(_hlo_bytes(shape) for shape in
                     re.findall(r"= (\S+) (?:copy|concatenate)\(", entry))
        out["copied_mb"] = copied / 1e6
        out["temp_mb"] = compiled.memory_analysis().temp_size_in_bytes / 1e6
    return out


def op_count_table(report: dict, args, dl: Deadline) -> None:
    counts = [int(c) for c in args.op_counts.split(",")]
    res = report.setdefault("op_counts", {"tensors": counts, "block": OP_COUNT_SHAPES})
    print(f"\n== ops of the jitted update + apply_updates for {counts} tensors "
          f"({OP_COUNT_SHAPES} repeated): lowered StableHLO ops / of them compute / "
          "compiled kernels (this backend), MB copied by unfused copies and concatenations, "
          "temp MB", flush=True)
    for label, build in op_count_transforms():
        row = res.setdefault(label, {})
        for n in counts:
            if dl.left() < 10:
                note(report, f"op counts: {label} at {n} skipped (deadline)")
                break
            try:
                row[str(n)] = op_counts(build(), n)
            except Exception as e:  # noqa: BLE001
                row[str(n)] = {"error": err(e)}
        cells = ["{ops}/{compute}/{kernels} {copied_mb:.2f} {temp_mb:.1f}".format(**row[str(n)])
                 if "ops" in row.get(str(n), {}) else row.get(str(n), {}).get("error", "-")
                 for n in counts]
        print(f"  {label:34s} " + " | ".join(f"{c:>27s}" for c in cells), flush=True)
        write(report, args)


#: --diagnose: ragged (rows odd, columns not a multiple of the kernels' 64), ViT-B/16's
#: position embedding rows, one of its MLP matrices
DIAG_SHAPES = [(5, 70), (197, 768), (3072, 768)]
DIAG_CONFIGS = [("small_fc_lopt", "exact"), ("small_fc_lopt", "fast"), ("velo", "exact")]


def _diag_inputs(method: str, hp, shape, n: int = 2) -> list:
    """``n`` tensors of ``shape`` stacked: p, g and a state with every accumulator nonzero
    (as after some steps), in the kernels' argument order."""
    from xopt.specs import small_fc_lopt as sfc
    from xopt.specs import velo as sv

    spec = sfc if method == "small_fc_lopt" else sv
    st = spec.param_state_shapes(hp, shape)
    keys = jax.random.split(jax.random.PRNGKey(sum(shape)), 7)
    p = 0.02 * jax.random.normal(keys[0], (n, *shape), jnp.float32)
    g = 1e-3 * jax.random.normal(keys[1], (n, *shape), jnp.float32)
    m = 1e-4 * jax.random.normal(keys[2], (n, *st["m"]), jnp.float32)
    pos = [1e-7 * (1 + jax.random.uniform(k, (n, *st[v]), jnp.float32))
           for k, v in zip(keys[3:], ("rms", "v_row", "v_col", "v_diag"), strict=True)]
    return [p, g, m, *pos]


def _diff(a, b) -> dict:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    d = float(np.abs(a - b).max()) if a.size else 0.0
    return {"max_abs": d, "max_rel": d / max(float(np.abs(b).max()), 1e-300) if d else 0.0,
            "nonfinite": int((~np.isfinite(a)).sum())}


_THETA: dict = {}


def _diag_theta(method: str) -> dict:
    """θ of the method at the bench's configuration, drawn once (VeLO's takes seconds)."""
    from xopt.specs import small_fc_lopt as sfc
    from xopt.specs import velo as sv

    if method not in _THETA:
        if method == "small_fc_lopt":
            hp = sfc.SmallFCLOpt(**SMALL_FC)
            _THETA[method] = sfc.coerce_meta(sfc.meta_init(hp, 0), hp)
        else:
            hp = sv.VeLO(**VELO)
            _THETA[method] = sv.coerce_meta(sv.meta_init(hp, 0), hp)
    return _THETA[method]


def diagnose_kernels(report: dict, args, dl: Deadline) -> None:
    """Each Pallas kernel against the plain path's math, one shape group at a time."""
    from xopt.jax import _lopt_pallas as K  # the kernels themselves, outside the optimizer
    from xopt.specs import small_fc_lopt as sfc
    from xopt.specs import velo as sv

    out = report.setdefault("diagnose", {}).setdefault("kernels", {})
    print("\n== Pallas kernels against the plain path's math (2 tensors per group): "
          "max abs diff (max rel), NaN/inf count", flush=True)
    for method, prec in DIAG_CONFIGS:
        if method == "small_fc_lopt":
            hp = sfc.SmallFCLOpt(**SMALL_FC)
            meta = {k: jnp.asarray(v) for k, v in _diag_theta(method).items()}
            kern = K.SmallFCKernels(hp, meta, prec)
            names = ("sfc_stats", "sfc_fused")
            tf = sfc.time_features(jnp, jnp.int32(3), meta["mlp/b0"])
            decays = sfc.decays(hp, meta, xp=jnp)

            def ref(p, g, m, rms, vr, vc, vd, hp=hp, meta=meta, tf=tf, decays=decays):
                step, accs, aux = sfc.compute_step(hp, p, g, m, rms, vr, vc, vd, tf, meta,
                                                   decays, xp=jnp, return_aux=True)
                return step, accs[0], accs[1], aux["feature_sq_mean"]

            def fast(shape, *a, kern=kern, tf=tf, decays=decays):
                aux: dict = {}
                res = kern(shape, *a, tf=tf, decays=decays, aux=aux)
                return (*(jnp.stack(r) for r in res[:3]), aux["feature_sq_mean"],
                        aux["stats"])
        else:
            hp = sv.VeLO(**VELO)
            meta = {k: jnp.asarray(v) for k, v in _diag_theta(method).items()}
            kern = K.VeLOKernels(hp, meta)
            names = ("velo_stats", "velo_fused")
            decays = tuple(jnp.asarray(d) for d in sv.decay_arrays(hp))
            controls = 0.1 * jax.random.normal(jax.random.PRNGKey(5), (2, hp.param_inits))
            lr_mult = jnp.asarray([0.3, -0.2], jnp.float32)

            def ref(p, g, m, rms, vr, vc, vd, c, s, hp=hp, meta=meta, decays=decays):
                aux: dict = {}
                step, accs = sv.update_tensor(jnp, hp, p, g, m, rms, vr, vc, vd, c, s, meta,
                                              decays, aux=aux)
                return step, accs[0], accs[1], aux["feature_sq_mean"]

            def fast(shape, *a, kern=kern, decays=decays):
                aux: dict = {}
                res = kern(shape, *a, decays=decays, aux=aux)
                return (*(jnp.stack(r) for r in res[:3]), aux["feature_sq_mean"],
                        aux["stats"])
        for shape in DIAG_SHAPES:
            label = f"{method}/{prec} {shape}"
            if dl.left() < 15:
                note(report, f"diagnose: {label} skipped (deadline)")
                continue
            try:
                args_ = _diag_inputs(method, hp, shape)
                if method == "velo":
                    args_ += [controls, lr_mult]
                want = jax.jit(jax.vmap(ref))(*args_)
                got = jax.jit(functools.partial(fast, shape))(*args_)
                res = {names[0]: {"feature_sq_mean": _diff(got[3], want[3]),
                                  "stats_nonfinite": int((~np.isfinite(
                                      np.asarray(got[4]))).sum())},
                       names[1]: {"step": _diff(got[0], want[0]), "m": _diff(got[1], want[1]),
                                  "rms": _diff(got[2], want[2])}}
            except Exception as e:  # noqa: BLE001
                out[label] = {"error": err(e)}
                note(report, f"diagnose {label}: {err(e)}")
                continue
            out[label] = res
            st, fu = res[names[0]], res[names[1]]
            bad_stats = st["feature_sq_mean"]["nonfinite"] + st["stats_nonfinite"]
            bad_fused = sum(v["nonfinite"] for v in fu.values())
            print(f"  {label:34s} {names[0]}: feature_sq_mean "
                  f"{st['feature_sq_mean']['max_abs']:.2e} ({st['feature_sq_mean']['max_rel']:.1e})"
                  f" NaN/inf {bad_stats} | {names[1]}: step {fu['step']['max_abs']:.2e} "
                  f"({fu['step']['max_rel']:.1e}) m {fu['m']['max_abs']:.1e} rms "
                  f"{fu['rms']['max_abs']:.1e} NaN/inf {bad_fused}", flush=True)
            write(report, args)


def diagnose_update(report: dict, args, dl: Deadline) -> None:
    """The whole jitted update, impl="pallas" against "plain", 2 steps, on a small model of
    the diagnostic shapes (and a vector, which takes the packed path)."""
    shapes = DIAG_SHAPES + [(70,), DIAG_SHAPES[0]]
    out = report.setdefault("diagnose", {}).setdefault("update", {})
    print(f"\n== the whole update on {shapes}: pallas against plain, 2 steps", flush=True)
    for method, prec in DIAG_CONFIGS:
        label = f"{method}/{prec}"
        if dl.left() < 20:
            note(report, f"diagnose: update {label} skipped (deadline)")
            continue
        try:
            theta = _diag_theta(method)
            ref_steps, ref_p, ref_s, _ = run_jax_steps(method, "plain", "exact", shapes,
                                                       meta_params=theta)
            steps, p, s, _ = run_jax_steps(method, "pallas", prec, shapes, meta_params=theta)
        except Exception as e:  # noqa: BLE001
            out[label] = {"error": err(e)}
            note(report, f"diagnose update {label}: {err(e)}")
            continue
        res = {"step": max((_diff(a, b) for st, rt in zip(steps, ref_steps, strict=True)
                            for a, b in zip(st, rt, strict=True)), key=lambda d: d["max_rel"]),
               "params": max((_diff(a, b) for a, b in zip(p, ref_p, strict=True)),
                             key=lambda d: d["max_rel"]),
               "state": max((_diff(a, b) for a, b in zip(s, ref_s, strict=True)),
                            key=lambda d: d["max_rel"])}
        res["nonfinite"] = sum(int((~np.isfinite(np.asarray(x))).sum())
                               for x in [*p, *s, *(u for st in steps for u in st)])
        out[label] = res
        print(f"  {label:22s} step {res['step']['max_abs']:.2e} ({res['step']['max_rel']:.1e})"
              f"  params {res['params']['max_rel']:.1e}  state {res['state']['max_rel']:.1e}"
              f"  NaN/inf {res['nonfinite']}", flush=True)
        write(report, args)


# -- --breakdown: where the Pallas update's time goes --------------------------------------

#: the breakdown's paths by default (--breakdown-paths)
BREAKDOWN = "small_fc_lopt/exact,small_fc_lopt/fast,velo/exact"
#: stage kinds: the Pallas kernels, the XLA glue of a kernel group, a whole group on the packed
#: XLA path (vectors, scalars, 3-D), the packing and unpacking, the rest
KERNEL_STAGES = ("stats", "fused")
GLUE_STAGES = ("prep", "norm")
#: opcodes of a compiled entry computation that launch nothing
_NO_LAUNCH = {"parameter", "tuple", "get-tuple-element", "constant", "bitcast", "after-all",
              "partition-id", "replica-id", "opt-barrier"}


def entry_launches(hlo_text: str) -> int:
    """Instructions of the compiled program's ENTRY computation that run something (on a GPU:
    about one kernel launch each; fusions, custom calls, copies)."""
    n, inside = 0, False
    for line in hlo_text.splitlines():
        if line.startswith("ENTRY "):
            inside = True
            continue
        if inside:
            if line.startswith("}"):
                break
            op = re.search(r"=.*?\s([a-z][a-z\-]*)\(", line)
            if op and op.group(1) not in _NO_LAUNCH:
                n += 1
    return n


def _nbytes(tree) -> int:
    return int(sum(x.nbytes for x in jax.tree.leaves(tree) if hasattr(x, "nbytes")))


class StageTimer:
    """The fast paths' stage runner (``method.stage``): each stage compiled alone and run on
    its real inputs, ``reps`` timed calls after a warm one (median ms), with the bytes it
    must read and write (its array arguments and results) and its launches; each row
    printed as it is timed (a run cut short still shows the stages it reached)."""

    def __init__(self, reps: int, label: str = "") -> None:
        self.reps, self.rows, self.label = reps, [], label

    def __call__(self, name: str, fn, *args):
        stage, _, group = name.partition("@")
        compiled = jax.jit(fn).lower(*args).compile()
        out = compiled(*args)
        jax.block_until_ready(out)
        times = []
        for _ in range(self.reps):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            times.append((time.perf_counter() - t0) * 1e3)
        ms = statistics.median(times)
        nbytes = _nbytes(args) + _nbytes(out)
        kind = ("kernel" if stage in KERNEL_STAGES else "glue" if stage in GLUE_STAGES
                else "xla group" if stage == "xla" else stage)
        row = {"stage": stage, "group": group, "kind": kind, "ms": ms, "bytes": nbytes,
               "gb_s": nbytes / ms / 1e6, "launches": entry_launches(compiled.as_text())}
        self.rows.append(row)
        print(f"  [{self.label}] {kind:10s} {stage}@{group or '-'}: {ms:.3f} ms, "
              f"{nbytes / 1e6:.1f} MB, {row['gb_s']:.0f} GB/s, {row['launches']} launches",
              flush=True)
        return out


class _Capture:
    """The inner method a transformation is built with (``_lopt_fast.select``'s result)."""

    def __enter__(self):
        from xopt.jax import _lopt_fast

        self.mod, self.orig, self.methods = _lopt_fast, _lopt_fast.select, []

        def select(*a, **k):
            m = self.orig(*a, **k)
            self.methods.append(m)
            return m

        _lopt_fast.select = select
        return self

    def __exit__(self, *exc) -> None:
        self.mod.select = self.orig


def _functions_and_runs(text: str) -> tuple[dict[str, str], Callable[[str], int]]:
    """A lowered module's functions (name → text) and ``runs(name)``: how many times that
    function runs per call of ``main``, from the call sites in the functions that run."""
    bodies = {}
    for chunk in re.split(r"(?=func\.func )", text)[1:]:
        head = re.match(r"func\.func (?:public |private )?@([\w$.]+)", chunk)
        bodies[head.group(1)] = chunk
    sites = {f: re.findall(r"(?<![\w$])call @([\w$.]+)\(", b) for f, b in bodies.items()}

    @functools.cache
    def runs(func: str) -> int:
        return 1 if func == "main" else sum(runs(g) * s.count(func)
                                            for g, s in sites.items() if func in s)

    return bodies, runs


def pallas_kernels(tx, params, state) -> list[dict]:
    """The Pallas kernels of ``tx``'s update as the GPU compiles them (lowered for CUDA from
    any backend): per kernel name, the calls, their grid sizes summed, the distinct kernels
    among the calls (``compiled``: XLA compiles one per distinct backend config) and the
    size of one call's Triton IR (bytes), what bounds the kernels' compile time."""
    from unittest import mock

    from xopt.jax import _lopt_pallas

    with mock.patch.object(_lopt_pallas, "_on_cpu", lambda: False):
        text = jax.jit(lambda g, s, p: tx.update(g, s, p, value=jnp.float32(1.0))).trace(
            params, state, params).lower(lowering_platforms=("cuda",)).as_text()
    bodies, runs = _functions_and_runs(text)
    out: dict = {}
    for func, body in bodies.items():
        for call in body.split("__gpu$xla.gpu.triton")[1:]:
            # (the attributes follow the operands, and the config is not cut at its closing
            # "}>": the IR's bytes may hold those two characters)
            cfg = call.split("}", 1)[0] if "backend_config = {" not in call else \
                call.split("backend_config = {", 1)[1]
            ir = re.search(r'ir = "((?:[^"\\]|\\.)*)"', cfg)
            attrs = cfg[:ir.start()] + cfg[ir.end():] if ir else cfg  # all but the IR
            name = re.search(r'name = "([^"]+)"', attrs)
            grid = re.search(r"grid_x = (\d+)", attrs)
            row = out.setdefault(name.group(1) if name else "?", {"calls": 0, "grid": 0,
                                                                 "ir_bytes": 0, "irs": set()})
            # a call inside a function (a jitted helper, lowered once) runs once per call
            # of that function
            n = runs(func)
            row["calls"] += n
            # XLA compiles one kernel per distinct backend config: the IR and the grid
            row["irs"].add((ir.group(1) if ir else "", grid.group(1) if grid else ""))
            row["grid"] += n * int(grid.group(1)) if grid else 0
            row["ir_bytes"] = max(row["ir_bytes"], len(ir.group(1)) if ir else 0)
    return [{"kernel": k, "calls": v["calls"], "compiled": len(v["irs"]), "grid": v["grid"],
             "ir_bytes": v["ir_bytes"]} for k, v in out.items()]


def torch_kernels(method: str, shapes, steps: int = 5) -> list[dict]:
    """The torch Triton path's kernels per step (torch.profiler, CUDA graphs off so that each
    launch is seen): per kernel name, launches and ms per step."""
    import lopt_step as L
    import torch

    os.environ["XOPT_LOPT_CUDA_GRAPHS"] = "0"
    try:
        params = L.make(shapes)
        opt, loss = L.build(method, params, "triton", "exact")
        for _ in range(3):
            opt.step(**({"loss": loss} if loss is not None else {}))
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                opt.step(**({"loss": loss} if loss is not None else {}))
            torch.cuda.synchronize()
    finally:
        os.environ.pop("XOPT_LOPT_CUDA_GRAPHS", None)
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if e.count and us:
            rows.append({"kernel": e.key[:60], "launches": e.count / steps,
                         "ms": us / 1e3 / steps})
    return sorted(rows, key=lambda r: -r["ms"])


def _tree_rel(a, b) -> float:
    return max((rel(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)),
               default=0.0)


def breakdown_one(model: str, method: str, precision: str, args, dl: Deadline | None = None,
                  label: str = "") -> dict:
    """One method's Pallas update on ``model``'s shapes, stage by stage (module docstring):
    the stages first (what the breakdown is for), then the whole step and optax.adamw's,
    then the inner update as one jit and the staged result against it, each of the last
    two only while ``dl`` leaves time (each compiles the whole update)."""
    shapes = MODELS[model]()
    params = device_params(shapes, 0, 0.02)
    grads = device_params(shapes, 7, 1e-3)
    loss = jnp.float32(1.0)
    with _Capture() as cap:
        tx = make_tx(method, "pallas", precision)
    inner_method = cap.methods[-1]
    state = tx.init(params)
    out: dict = {"kernels": pallas_kernels(tx, params, state)}

    def timed(fn, *a):
        compiled = jax.jit(fn).lower(*a).compile()
        res = compiled(*a)
        jax.block_until_ready(res)
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(*a))
            times.append((time.perf_counter() - t0) * 1e3)
        return res, statistics.median(times), entry_launches(compiled.as_text())

    def room(seconds: float) -> bool:
        return dl is None or dl.left() > seconds

    timer = StageTimer(args.reps, label)
    inner_method.stage = timer
    try:
        staged = inner_method.update(params, grads, loss, state.iteration, state.inner)
    finally:
        inner_method.stage = None
    out["stages"] = timer.rows
    if room(20):
        _, out["adamw_ms"], out["adamw_launches"] = timed(
            _step_body(optax.adamw(1e-3), "adamw"), params, optax.adamw(1e-3).init(params),
            grads, loss)
    if room(40):
        _, out["step_ms"], out["step_launches"] = timed(_step_body(tx, method), params,
                                                        state, grads, loss)
    if room(40):
        whole, out["inner_ms"], out["inner_launches"] = timed(
            inner_method.update, params, grads, loss, state.iteration, state.inner)
        out["staged_vs_one_jit"] = {"step_max_rel": _tree_rel(staged[0], whole[0]),
                                    "state_max_rel": _tree_rel(staged[1], whole[1])}
    return out


def breakdown_table(label: str, res: dict) -> None:
    """Prints one breakdown: the stages summed by kind and stage name, then the totals."""
    rows = res["stages"]
    print(f"\n{label}: stage (groups), ms, MB read+written, GB/s, launches")
    agg: dict = {}
    for r in rows:
        a = agg.setdefault((r["kind"], r["stage"]), {"n": 0, "ms": 0.0, "bytes": 0,
                                                     "launches": 0})
        a["n"] += 1
        a["ms"] += r["ms"]
        a["bytes"] += r["bytes"]
        a["launches"] += r["launches"]
    for (kind, stage), a in agg.items():
        print(f"  {kind:10s} {stage:8s} ({a['n']:3d}) {a['ms']:10.3f} {a['bytes'] / 1e6:10.1f} "
              f"{a['bytes'] / max(a['ms'], 1e-9) / 1e6:8.1f} {a['launches']:6d}")
    total = sum(r["ms"] for r in rows)
    print(f"  {'sum of stages':30s}{total:10.3f}   launches {sum(r['launches'] for r in rows)}")
    if "inner_ms" in res:
        print(f"  {'inner update, one jit':30s}{res['inner_ms']:10.3f}   launches "
              f"{res['inner_launches']}")
    if "step_ms" in res and "adamw_ms" in res:
        print(f"  {'whole step (update+apply)':30s}{res['step_ms']:10.3f}   launches "
              f"{res['step_launches']}   ({res['step_ms'] / res['adamw_ms']:.2f}x optax.adamw "
              f"{res['adamw_ms']:.3f} ms, {res['adamw_launches']} launches)")
    top = sorted(rows, key=lambda r: -r["ms"])[:8]
    print("  slowest stages: " + "; ".join(f"{r['stage']}@{r['group']} {r['ms']:.3f} ms "
                                          f"{r['gb_s']:.0f} GB/s" for r in top))
    if "staged_vs_one_jit" in res:
        c = res["staged_vs_one_jit"]
        print(f"  staged vs one jit: step {c['step_max_rel']:.1e}, state "
              f"{c['state_max_rel']:.1e}")
    for k in res["kernels"]:
        print(f"  pallas_call {k['kernel']:11s} x{k['calls']:3d} ({k['compiled']} compiled)  "
              f"grid {k['grid']:9d}  Triton IR {k['ir_bytes'] / 1e3:7.1f} kB")
    for k in res.get("torch", []):
        print(f"  torch {k['kernel']:48s} {k['launches']:6.1f}/step {k['ms']:9.3f} ms")


def breakdown(report: dict, args, dl: Deadline) -> None:
    model = args.breakdown
    out = report.setdefault("breakdown", {}).setdefault(model, {})
    why_torch = torch_cuda()
    for method, precision in (p.split("/") for p in args.breakdown_paths.split(",")):
        label = f"{model} {method} pallas {precision}"
        if dl.left() < 30:
            note(report, f"breakdown {label} skipped (deadline)")
            continue
        try:
            res = breakdown_one(model, method, precision, args, dl, label)
        except Exception as e:  # noqa: BLE001
            note(report, f"breakdown {label} failed: {err(e)}")
            traceback.print_exc(limit=4)
            continue
        if why_torch is None and precision == "exact" and dl.left() > 20:
            try:
                res["torch"] = torch_kernels(method, MODELS[model]())
            except Exception as e:  # noqa: BLE001
                note(report, f"breakdown {label}: torch kernels failed: {err(e)}")
        out[f"{method}/{precision}"] = res
        breakdown_table(label, res)
        write(report, args)
    if why_torch is not None:
        note(report, f"breakdown: torch Triton kernels not profiled: {why_torch}")


def write(report: dict, args) -> None:
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lopt_step_jax.json").write_text(json.dumps(report, indent=1, default=str))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--models", default=None, help="default: vit_b16,gpt2_medium (tiny: tiny)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run on a tiny model (CI)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=4, help="timed calls per entry and round")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="skip what would start after this many seconds (default 540; "
                    "--diagnose: 90)")
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--no-golden", action="store_true")
    ap.add_argument("--no-survey", action="store_true")
    ap.add_argument("--plain", action="store_true",
                    help="also the plain learned optimizers (slow to compile)")
    ap.add_argument("--only", default="", help="time only the JAX labels containing one of "
                    "these comma-separated strings")
    ap.add_argument("--survey", default="", help="compile survey: only the transforms whose "
                    "label contains one of these comma-separated strings")
    ap.add_argument("--diagnose", action="store_true",
                    help="only each Pallas kernel and the Pallas update against plain, on a "
                    "few shapes: max abs diff and NaN/inf (default --deadline-s 90)")
    ap.add_argument("--diag-shapes", default="", metavar="AxB,...",
                    help="--diagnose on these 2-D shapes instead of DIAG_SHAPES")
    ap.add_argument("--breakdown", default="", metavar="MODEL",
                    help="first, the Pallas update on MODEL's shapes stage by stage (each "
                    "stage compiled and timed alone on its real inputs), with its kernels' "
                    "sizes and, on CUDA, the torch Triton path's kernels per step")
    ap.add_argument("--breakdown-paths", default=BREAKDOWN, metavar="METHOD/PRECISION,...")
    ap.add_argument("--breakdown-only", action="store_true",
                    help="only the breakdown (CI: --tiny --breakdown tiny --breakdown-only)")
    ap.add_argument("--survey-models", default=None, metavar="MODEL,...",
                    help="the compile survey's models (default gpt2_medium; --tiny: tiny)")
    ap.add_argument("--compiler-option", action="append", default=[], metavar="KEY=VALUE",
                    help="an XLA option for every jitted step, e.g. "
                    "xla_gpu_enable_triton_gemm=false (repeatable)")
    ap.add_argument("--op-counts", default="", metavar="N,N,...",
                    help="only count the ops and kernels of every transform's jitted update "
                    "at these tensor counts (e.g. 8,32,128; any backend)")
    args = ap.parse_args()
    for kv in args.compiler_option:
        k, _, v = kv.partition("=")
        COMPILER_OPTIONS[k] = {"true": True, "false": False}.get(v.lower(), v)
    if args.diag_shapes:
        DIAG_SHAPES[:] = [tuple(int(d) for d in s.split("x")) for s in args.diag_shapes.split(",")]
    if args.deadline_s is None:
        args.deadline_s = 90.0 if args.diagnose else 540.0
    dl = Deadline(args.deadline_s)
    models = (args.models or ("tiny" if args.tiny else "vit_b16,gpt2_medium")).split(",")
    if args.tiny:
        args.rounds, args.reps = min(args.rounds, 1), min(args.reps, 2)
    dev = jax.devices()[0]
    report = {"device": str(getattr(dev, "device_kind", dev)), "backend": jax.default_backend(),
              "date": datetime.date.today().isoformat(), "jax": jax.__version__,
              "optax": optax.__version__, "models": {}, "notes": [],
              "config": {"small_fc_lopt": SMALL_FC, "velo": VELO},
              "compiler_options": COMPILER_OPTIONS}
    print(f"{report['device']} ({report['backend']}); {report['date']}; jax {jax.__version__}",
          flush=True)
    if args.op_counts or args.diagnose:
        if args.op_counts:
            op_count_table(report, args, dl)
        if args.diagnose:
            diagnose_kernels(report, args, dl)
            diagnose_update(report, args, dl)
        write(report, args)
        print(f"\nwrote {Path(args.out_dir) / 'lopt_step_jax.json'}", flush=True)
        return
    if report["backend"] != "gpu" and not args.tiny:
        note(report, "no GPU: the figures are the CPU's (the Pallas kernels interpreted)")
    if args.breakdown:
        breakdown(report, args, dl)
        write(report, args)
        if args.breakdown_only:
            print(f"\nwrote {Path(args.out_dir) / 'lopt_step_jax.json'}", flush=True)
            return
    for model in models:
        try:
            bench_model(model, args, report, dl)
        except Exception as e:  # noqa: BLE001
            note(report, f"{model}: {err(e)}")
            traceback.print_exc(limit=4)
        write(report, args)
    if not args.no_golden:
        try:
            golden(report, dl)
        except Exception as e:  # noqa: BLE001
            note(report, f"golden: {err(e)}")
        write(report, args)
    for model in models if not args.skip_checks else ():
        try:
            check_model(model, args, report, dl)
        except Exception as e:  # noqa: BLE001
            note(report, f"{model} checks: {err(e)}")
    if not args.no_survey:
        for survey_model in (args.survey_models
                             or ("tiny" if args.tiny else "gpt2_medium")).split(","):
            try:
                compile_survey(survey_model, report, dl, args)
            except Exception as e:  # noqa: BLE001
                note(report, f"compile survey: {err(e)}")
            write(report, args)
    print(f"\nwrote {Path(args.out_dir) / 'lopt_step_jax.json'}", flush=True)


if __name__ == "__main__":
    main()
