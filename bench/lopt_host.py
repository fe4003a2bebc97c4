"""Host time of a learned optimizer's Triton step, by phase and by per-tensor pass.

    python bench/lopt_host.py [--models vit_b16,gpt2_medium] [--method velo]

On one CUDA GPU, for each model's shapes (bench/lopt_step.py's): the median host time of
``step()`` (perf_counter, the GPU idle at each start), of its phases (wrapped methods), and
of each C-level pass over the tensors that a steady step makes (``.grad``, ``data_ptr``,
``is_contiguous``, ``.shape``, ``_version``, the state identity check), so that the cost
per tensor of each can be read off this host.
"""

from __future__ import annotations

import argparse
import operator
import statistics
import sys
import time
import timeit
from itertools import chain
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import lopt_step as B  # noqa: E402


def med_us(f, number: int = 50, repeat: int = 5) -> float:
    return min(timeit.repeat(f, number=number, repeat=repeat)) / number * 1e6


def run(model: str, method: str, reps: int) -> None:
    shapes = B.MODELS[model]()
    params = B.make(shapes)
    opt, loss = B.build(method, params, "triton")
    for _ in range(4):
        B._step(opt, loss)
    torch.cuda.synchronize()
    host = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        B._step(opt, loss)
        host.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    print(f"== {model} ({len(shapes)} tensors) {method}: host time of step() median "
          f"{statistics.median(host) * 1e3:.3f} ms, min {min(host) * 1e3:.3f} ms")
    times: dict[str, list[float]] = {}

    def wrap(obj, name: str, label: str) -> None:
        f = getattr(obj, name)

        def w(*a, **k):
            t0 = time.perf_counter()
            r = f(*a, **k)
            times.setdefault(label, []).append(time.perf_counter() - t0)
            return r
        setattr(obj, name, w)

    for n in ("_steady_io", "_gather", "_fast_triton_io", "_loss_tensor", "_triton_fast_update",
              "_triton_update"):
        if hasattr(opt, n):
            wrap(opt, n, n)
    tri = opt._triton
    for n in ("step", "_tables", "_carried", "_bank", "_sync_loss_buffer", "_step"):
        if hasattr(tri, n):
            wrap(tri, n, "triton." + n)
    wrap(tri._graph, "run", "graph.run")
    for _ in range(reps):
        torch.cuda.synchronize()
        B._step(opt, loss)
    torch.cuda.synchronize()
    for k, v in times.items():
        print(f"  {k:28s} {statistics.median(v) * 1e3:8.3f} ms  (n={len(v)})")
    # the per-tensor passes, on this optimizer's lists
    ps = [p for g in opt.param_groups for p in g["params"]]
    grads = [p.grad for p in ps]
    states = [opt.state[p] for p in ps]
    flat = list(chain.from_iterable(map(dict.values, states)))
    n = len(ps)
    passes = {
        "is_ params": lambda: all(map(operator.is_, ps, ps)),
        ".grad": lambda: list(map(operator.attrgetter("grad"), ps)),
        "data_ptr": lambda: list(map(torch.Tensor.data_ptr, grads)),
        "is_contiguous": lambda: all(map(torch.Tensor.is_contiguous, grads)),
        ".shape": lambda: list(map(operator.attrgetter("shape"), grads)),
        "._version": lambda: list(map(operator.attrgetter("_version"), grads)),
        "state identity": lambda: all(map(operator.is_,
                                          chain.from_iterable(map(dict.values, states)), flat)),
    }
    for k, f in passes.items():
        t = med_us(f)
        print(f"  pass {k:18s} {t:8.1f} us  ({t / n * 1e3:6.1f} ns per tensor)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="vit_b16,gpt2_medium")
    ap.add_argument("--method", default="velo")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, sys.version.split()[0])
    for m in args.models.split(","):
        run(m, args.method, args.reps)


if __name__ == "__main__":
    main()
