"""POET-X layer benchmark: forward+backward latency and peak memory of one layer.

    python bench/poet_layer.py [--out RESULTS.json] [--dtype bf16|fp32] [--check] [--tiny]
                               [--rounds N] [--shapes 4096x4096] [--blocks 256,512]
                               [--cnp fused,bmm] [--direct off,on]
                               [--fused-tiles 128x32x8,64x32x4] [--graphs off,on]

At LLaMA-8B-like shapes (4096×4096 and 4096→14336, block sizes 256 and 512, 4096 tokens)
it times, in one run: ``nn.Linear`` (the weight trained, as in AdamW pre-training), xopt's
``POETLinear`` fast and mem variants (``impl="triton"`` on CUDA: fused CNP and gather
kernels; ``impl="plain"`` too, to show what the kernels buy) and the authors' POET-X
(``poet_torch.POETLinear``) when it is importable. Latency: median of CUDA-event timings of
``y = layer(x); y.backward(g)`` after warm-up. Peak memory: ``max_memory_allocated``
during that call minus what was allocated before it (layer, input, cotangent), i.e. the
memory the forward/backward itself needs (activations kept for backward, gradients,
workspaces). ``--rounds N`` adds, per shape, nn.Linear and the fast layers timed side by
side: N interleaved rounds of CUDA-graph replays, each after 50 ms of idle GPU
(:func:`side_by_side`); the ratio of medians is the figure for a speed target.
Each row also gives its device-kernel launches per forward+backward, counted on the host
(:func:`xopt.kernels.poet_launches.count_launches`; not for the authors' compiled layer;
``21/7d``: 7 of the 21 through :mod:`xopt.kernels.poet_jit`'s direct path),
and the run ends with a summary of the fast layers: eager back to back ("piped") and
graph time, each against nn.Linear's, the launches and the host's time per call (the
piped loop's wall time before its sync). ``--direct off,on`` times the triton rows with
and without :mod:`xopt.kernels.poet_jit`'s direct launches. ``--graphs off,on`` adds, for
each triton row, the layer with ``cuda_graphs=True`` (its eager calls replayed from CUDA
graphs, :mod:`xopt.torch.poet_graphs`): its eager and piped columns are the graphed eager
calls (its graph column captures the whole call, in which the layer runs its eager path),
"held MiB" the memory its graphs and buffers keep between calls; its launches exclude
the two graph replays per forward+backward (printed with its capture counts).

``--check`` first validates the kernels on the device against their PyTorch references
(float32) and runs the parity harness on the bundled POET traces with ``impl="triton"``.
``--tiny`` runs small shapes on the CPU (smoke test; timings meaningless), the Triton
kernels too under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from xopt.kernels.poet_launches import count_launches  # noqa: E402
from xopt.torch.poet import POETLinear  # noqa: E402


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def measure(layer: nn.Module, x: torch.Tensor, g: torch.Tensor, iters: int, warmup: int,
            count: bool = True):
    """``(ms, peak MiB, piped ms, graph ms, launches, host us, held MiB)`` of ``layer``'s
    forward+backward; host us: the host's time per call in the piped loop (the loop's wall
    time before its one sync; the launch queue does not fill in ``iters`` calls); held
    MiB: what the layer's warm-up left allocated (a graphed layer's graphs and buffers)."""
    dev = x.device
    held0 = torch.cuda.memory_allocated() if dev.type == "cuda" else None
    held = None

    def once():
        if x.grad is not None:
            x.grad = None
        for p in layer.parameters():
            p.grad = None
        layer(x).backward(g)

    for _ in range(warmup):
        once()
    _sync(dev)
    if held0 is not None:  # what the layer keeps between calls (graphs, their buffers)
        for p in layer.parameters():
            p.grad = None
        x.grad = None
        held = (torch.cuda.memory_allocated() - held0) / 2**20
    times = []
    for _ in range(iters):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            once()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            once()
            times.append((time.perf_counter() - t0) * 1e3)
    pipelined = host_us = None
    if dev.type == "cuda":  # back to back, one sync: the host may run ahead of the GPU
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t0 = time.perf_counter()
        for _ in range(iters):
            once()
        host_us = (time.perf_counter() - t0) * 1e6 / iters
        b.record()
        torch.cuda.synchronize()
        pipelined = a.elapsed_time(b) / iters
    peak = None
    if dev.type == "cuda":
        x.grad = None
        for p in layer.parameters():
            p.grad = None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        once()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    graph = graph_ms(layer, x, g, iters) if dev.type == "cuda" else None
    launches = None
    if count:
        c = count_launches(once)
        launches = (c.launches, c.direct)
    return statistics.median(times), peak, pipelined, graph, launches, host_us, held


def _grad_reset(layer: nn.Module, x: torch.Tensor):
    """A function that drops ``x``'s and ``layer``'s trainable parameters' gradients."""
    params = [p for p in layer.parameters() if p.requires_grad]

    def reset():
        x.grad = None
        for p in params:
            p.grad = None

    return reset


def capture(layer: nn.Module, x: torch.Tensor, g: torch.Tensor):
    """One forward+backward of ``layer`` captured in a CUDA graph (after warm-up on a side
    stream; the leaves' gradients dropped first, so no accumulation is captured). Returns
    ``(graph, reset)``; ``reset()`` drops the gradients again."""
    reset = _grad_reset(layer, x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            reset()
            layer(x).backward(g)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    reset()
    cg = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cg):
        layer(x).backward(g)
    cg.replay()
    torch.cuda.synchronize()
    return cg, reset


def replay_ms(cg, iters: int) -> float:
    """Mean ms of ``iters`` back-to-back replays of ``cg``."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        cg.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters


def graph_ms(layer: nn.Module, x: torch.Tensor, g: torch.Tensor, iters: int):
    """GPU time of one forward+backward with the host out of the way: the call is captured
    once in a CUDA graph (:func:`capture`) and the graph replayed back to back. ``None``
    (and a note) if the layer cannot be captured."""
    try:
        cg, _ = capture(layer, x, g)
        ms = replay_ms(cg, iters)
        del cg
    except Exception as e:  # report, keep the eager numbers
        print(f"note: CUDA-graph capture of {type(layer).__name__} failed: {e!r}"[:300])
        ms = None
    _grad_reset(layer, x)()  # (also after a failed capture)
    torch.cuda.synchronize()
    return ms


def side_by_side(builders: dict, x: torch.Tensor, g: torch.Tensor, rounds: int,
                 iters: int, idle_s: float = 0.05) -> dict:
    """Graph ms of each layer of ``builders`` ({label: function returning the module or
    ``None``}) in ``rounds`` interleaved rounds: each layer is built and captured at once
    (before the next is built: the authors' compiled core is compiled for its own shape,
    see :func:`authors_layer`), then each round replays every graph ``iters`` times, the
    order rotated by one each round, each batch of replays after ``idle_s`` of idle GPU.

    The idle gap matters: on the H200, nn.Linear's and the fast layer's graphs each ran in
    one of two states, about 10% apart, when replayed back to back after other work (SM
    clock sampled down to 1.6-1.7 GHz from 1.98), and always in the faster one after 50 ms
    idle (bench/RESULTS.md, "POET-X layer"). Without the gap a ratio could compare one
    layer's fast state with the other's slow one.
    Returns {label: [ms per round]}."""
    graphs, keep = {}, []
    for label, build in builders.items():
        try:
            layer = build()
            if layer is None:
                continue
            graphs[label] = capture(layer, x, g)
            keep.append(layer)
        except Exception as e:  # keep the others
            print(f"note: building or capturing {label} failed: {e!r}"[:300])
    labels = list(graphs)
    out = {label: [] for label in labels}
    for r in range(rounds):
        for label in labels[r % len(labels):] + labels[:r % len(labels)]:
            torch.cuda.synchronize()
            time.sleep(idle_s)
            out[label].append(replay_ms(graphs[label][0], iters))
    for _cg, reset in graphs.values():
        reset()
    del graphs, keep
    torch.cuda.synchronize()
    return out


def authors_layer(n_in, n_out, b, mem, dtype, dev):
    """The authors' layer, its ``torch.compile``'d core compiled afresh: without the reset,
    a layer of another shape recompiles the shared ``forward_core`` with dynamic shapes
    (dynamo's automatic dynamic shapes) and slower kernels, or stops at its recompile
    limit, and every shape but the first would be measured too slow."""
    if importlib.util.find_spec("poet_torch") is None:
        return None
    from poet_torch.layers.poet_linear import POETLinear as Orig  # pragma: no cover

    torch._dynamo.reset()

    layer = Orig(n_in, n_out, block_size=b, mem_efficient_mode=mem, device=dev, dtype=dtype)
    nn.init.normal_(layer.weight)
    return layer


def check(dev) -> dict:
    """Kernels vs references on the device (float32), and the triton parity run."""
    from xopt.kernels import poet_cayley as K
    from xopt.kernels import poet_perm as PP

    out = {}
    torch.manual_seed(0)
    for b in (16, 64, 256, 512):
        m = b * (b - 1) // 2
        x = (0.3 / b**0.5) * torch.randn(4, m, device=dev)
        q = K.skew(x, b)
        out[f"skew_b{b}_maxabs"] = (q - K.skew_reference(x, b)).abs().max().item()
        for f in ("product", "taylor"):
            y, q2 = K.cnp_forward(q, f)
            yr = K.cayley_neumann_reference(q.double(), f)
            out[f"cnp_{f}_b{b}_rel"] = ((y.double() - yr).abs().max() / yr.abs().max()).item()
            gr = torch.randn(4, b, b, device=dev)
            dq = K.cnp_backward(q, q2, gr, f)
            qq = q.double().requires_grad_()
            K.cayley_neumann_reference(qq, f).backward(gr.double())
            out[f"cnp_bwd_{f}_b{b}_rel"] = ((dq.double() - qq.grad).abs().max()
                                           / qq.grad.abs().max()).item()
        dq = torch.randn(4, b, b, device=dev)
        out[f"triu_b{b}_maxabs"] = (K.triu_grad(dq, b) - K.triu_grad_reference(dq, b)
                                    ).abs().max().item()
    xg = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    p = torch.randperm(4096, device=dev).to(torch.int32)
    out["gather_maxabs"] = (PP.gather(xg, p) - PP.gather_reference(xg, p)).abs().max().item()
    out["scatter_maxabs"] = (PP.scatter(xg, p) - PP.scatter_reference(xg, p)).abs().max().item()
    # POETAdamW's one-pass update against the foreach update it replaces on CUDA (the same
    # operations in the same order: expected equal), bf16 and float32 parameters
    from xopt.kernels import poet_adam
    from xopt.torch.poet import _foreach_update

    for pdt in (torch.bfloat16, torch.float32):
        p0 = torch.randn(1 << 20, device=dev).to(pdt)
        ref = [p0.clone(), torch.rand(1 << 20, device=dev), torch.rand(1 << 20, device=dev)]
        got = [t.clone() for t in ref]
        gr = torch.randn(1 << 20, device=dev).to(pdt)
        _foreach_update([ref[0]], [gr], [ref[1]], [ref[2]], 0.9, 0.999, 1e-8, 3e-3, -1e-4,
                        pdt != torch.float32)
        poet_adam.adam_update(got[0], gr, got[1], got[2], 0.9, 0.999, 1e-8, 3e-3, -1e-4)
        out[f"adam_{str(pdt)[6:]}_maxabs"] = max((u.float() - v.float()).abs().max().item()
                                                  for u, v in zip(got, ref, strict=True))
    # whole layer, triton vs plain, float32 (TF32 off), both variants
    torch.backends.cuda.matmul.allow_tf32 = False
    for var in ("fast", "mem"):
        torch.manual_seed(1)
        a = POETLinear(512, 768, 64, variant=var, impl="plain", device=dev)
        with torch.no_grad():
            a.oft_R.normal_(0, 0.05)
        bl = POETLinear(512, 768, 64, variant=var, impl="triton", device=dev)
        bl.load_state_dict(a.state_dict())
        x = torch.randn(8, 33, 512, device=dev)
        gy = torch.randn(8, 33, 768, device=dev)
        res = []
        for layer in (a, bl):
            xx = x.clone().requires_grad_()
            y = layer(xx)
            y.backward(gy)
            res.append((y, xx.grad, layer.oft_R.grad))
        for name, u, v in zip(("y", "grad_x", "grad_oft_R"), res[0], res[1], strict=True):
            out[f"layer_{var}_{name}_rel"] = ((u - v).abs().max() / v.abs().max()).item()
    from xopt.parity import bundled_traces, load_trace
    from xopt.parity.harness import run_parity
    from xopt.parity.report import table

    traces = [load_trace(p, validate=False) for p in bundled_traces("poet")]
    rep = run_parity("poet", traces, backends=["torch"], impl="triton", device="cuda")
    print(table(rep))
    out["parity_triton_cuda"] = {f"{r.trace}|{r.impl}|{r.mode}": r.max_rel_error
                                 for r in rep.runs}
    out["parity_triton_cuda_verdict"] = rep.verdict
    return out


def profile(dev, dtype, tokens, xopt_only: bool = False) -> dict:
    """Per-kernel CUDA times (torch.profiler, 5 fwd+bwd) of nn.Linear, xopt fast and mem
    (triton; fast at b = 512 too) and, unless ``xopt_only``, the authors' layers when
    importable, at 4096×4096, b = 256; with each
    layer's kernel count per fwd+bwd and its host time per fwd+bwd (launch-only: the
    calls return before the GPU finishes; measured without the profiler)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    out = {}
    x = torch.randn(1, tokens, 4096, device=dev, dtype=dtype, requires_grad=True)
    g = torch.randn(1, tokens, 4096, device=dev, dtype=dtype)
    layers = {"nn.Linear": lambda: nn.Linear(4096, 4096, bias=False, device=dev, dtype=dtype)}
    for var in ("fast", "mem"):
        layers[f"xopt {var}"] = lambda var=var: POETLinear(4096, 4096, 256, variant=var,
                                                           impl="triton", device=dev,
                                                           dtype=dtype)
    layers["xopt fast b=512"] = lambda: POETLinear(4096, 4096, 512, variant="fast",
                                                   impl="triton", device=dev, dtype=dtype)
    if importlib.util.find_spec("poet_torch") is not None and not xopt_only:
        for mem in (False, True):
            layers[f"authors {'mem' if mem else 'fast'}"] = \
                lambda mem=mem: authors_layer(4096, 4096, 256, mem, dtype, dev)
    for label, make in layers.items():
        layer = make()
        measure(layer, x, g, 3, 3)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            layer(x).backward(g)
        host_ms = (time.perf_counter() - t0) * 1e3 / 5
        torch.cuda.synchronize()
        with prof(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as p:
            for _ in range(5):
                layer(x).backward(g)
            torch.cuda.synchronize()
        kernels = [e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        gpu_us = sum(e.device_time for e in kernels) / 5
        table = p.key_averages().table(sort_by="cuda_time_total", row_limit=25,
                                       max_name_column_width=70)
        print(f"--- profile: {label}, 4096x4096, b=256, 5 fwd+bwd: {len(kernels) / 5:.0f} "
              f"GPU ops per fwd+bwd, their sum {gpu_us:.0f} us, host {host_ms:.3f} ms ---")
        print(table, flush=True)
        out[label] = {"gpu_ops": len(kernels) / 5, "gpu_us": gpu_us, "host_ms": host_ms,
                      "table": table}
        del layer
    return out


def rounds_table(n_in, n_out, blocks, x, g, rounds, iters, dtype, dev) -> list:
    """:func:`side_by_side` for nn.Linear, xopt fast (``impl="triton"``) and the authors'
    fast layer (when importable) at each block size of one shape; prints and returns the
    rows: median ms over rounds, its range, the ratio of medians to nn.Linear and the
    range of the per-round ratios (each round against that round's nn.Linear)."""
    def xopt_fast(b):
        layer = POETLinear(n_in, n_out, b, variant="fast", impl="triton", device=dev,
                           dtype=dtype)
        with torch.no_grad():
            layer.oft_R.normal_(0, 1e-3)
        return layer

    def authors_fast(b):
        orig = authors_layer(n_in, n_out, b, False, dtype, dev)
        if orig is not None:  # pragma: no cover - only where it is importable
            with torch.no_grad():
                orig.oft_R.normal_(0, 1e-3)
        return orig

    builders = {"nn.Linear": lambda: nn.Linear(n_in, n_out, bias=False, device=dev,
                                               dtype=dtype)}
    for b in blocks:
        builders[f"xopt fast b={b}"] = lambda b=b: xopt_fast(b)
        builders[f"authors fast b={b}"] = lambda b=b: authors_fast(b)
    times = side_by_side(builders, x, g, rounds, iters)
    ref = times.get("nn.Linear")
    print(f"side by side, {n_in}->{n_out}: {rounds} interleaved rounds of {iters} graph "
          f"replays each after 50 ms idle; median ms [range], x nn.Linear (ratio of medians) "
          f"[per-round range]")
    rows = []
    for label, ms in times.items():
        med = statistics.median(ms)
        row = {"layer": label, "in": n_in, "out": n_out, "rounds_ms": ms, "median_ms": med}
        text = f"  {label:22s} {med:8.4f} [{min(ms):.4f}, {max(ms):.4f}]"
        if ref and label != "nn.Linear":
            per = [a / r for a, r in zip(ms, ref, strict=True)]
            row.update(ratio=med / statistics.median(ref), round_ratios=per)
            text += f"  x{row['ratio']:.3f} [{min(per):.3f}, {max(per):.3f}]"
        print(text, flush=True)
        rows.append(row)
    torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write results as JSON here")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=0,
                    help="after each shape's table, time nn.Linear and the fast layers "
                         "(xopt's, the authors') side by side in this many interleaved rounds "
                         "of CUDA-graph replays (see side_by_side)")
    ap.add_argument("--check", action="store_true", help="validate kernels and parity first")
    ap.add_argument("--tiny", action="store_true", help="small CPU smoke run")
    ap.add_argument("--profile", action="store_true",
                    help="print torch.profiler's per-kernel CUDA times of xopt fast and mem "
                         "(triton, 4096x4096, b=256)")
    ap.add_argument("--profile-xopt-only", action="store_true",
                    help="--profile: nn.Linear and xopt only")
    ap.add_argument("--shapes", default="4096x4096,4096x14336",
                    help="in x out shapes on a GPU, comma-separated")
    ap.add_argument("--blocks", default="256,512", help="block sizes on a GPU")
    ap.add_argument("--impls", default="triton,plain",
                    help="xopt implementations in the table (on a GPU)")
    ap.add_argument("--direct", default="",
                    help="xopt.kernels.poet_jit direct launches for the triton rows, "
                         "comma-separated off/on (default: as XOPT_POET_DIRECT_LAUNCH says)")
    ap.add_argument("--fused-tiles", default="",
                    help="tiles of the fused CNP kernels for bf16/fp16 blocks, comma-separated "
                         "BMxBKxWARPS (e.g. 128x32x8,64x32x4): a row per choice for the "
                         "cnp=fused rows (default: poet_cayley.FUSED_TILES)")
    ap.add_argument("--graphs", default="off",
                    help="triton rows without/with cuda_graphs=True, comma-separated off/on")
    ap.add_argument("--cnp", default="",
                    help="CNP backends for the triton rows, comma-separated (default: "
                         "xopt.kernels.poet_cayley.BACKEND alone)")
    args = ap.parse_args(argv)

    dev = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    name = torch.cuda.get_device_name() if dev.type == "cuda" else platform.processor() or "cpu"
    print(f"device: {name} ({dev}); date: {datetime.date.today()}; torch {torch.__version__}; "
          f"python {platform.python_version()}; dtype {args.dtype}")
    result = {"device": name, "date": str(datetime.date.today()), "torch": torch.__version__,
              "dtype": args.dtype, "tokens": args.tokens, "rows": []}
    try:
        import triton

        result["triton"] = triton.__version__
    except ImportError:
        result["triton"] = None
    if args.check and dev.type == "cuda":
        try:
            result["check"] = check(dev)
        except Exception as e:  # report and go on to the timings
            import traceback

            traceback.print_exc()
            result["check"] = {"error": repr(e)}
        print(json.dumps({k: v for k, v in result["check"].items()
                          if not k.startswith("parity_triton_cuda")}, indent=1))
    if args.profile and dev.type == "cuda":
        result["profile"] = profile(dev, dtype, args.tokens, args.profile_xopt_only)
    if args.tiny:  # the kernels too where Triton's CPU interpreter is on (TRITON_INTERPRET=1)
        from xopt.kernels import interpreting

        shapes, blocks, tokens = [(64, 64), (64, 128)], [16, 32], 64
        impls = ["plain", "triton"] if interpreting() else ["plain"]
        args.iters, args.warmup = 2, 1
    else:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
        blocks, tokens = [int(v) for v in args.blocks.split(",")], args.tokens
        impls = args.impls.split(",") if dev.type == "cuda" else ["plain"]
    from xopt.kernels import poet_cayley as K
    from xopt.kernels import poet_jit

    cnps = args.cnp.split(",") if args.cnp else [K.BACKEND]
    directs = [d == "on" for d in args.direct.split(",")] if args.direct else [poet_jit.ENABLED]
    tiles = [tuple(int(v) for v in t.split("x")) for t in args.fused_tiles.split(",")
             ] if args.fused_tiles else [None]
    graphs = [v == "on" for v in args.graphs.split(",")]
    variants = [(impl, cnp, direct, tile, graph) for impl in impls
                for cnp in (cnps if impl == "triton" else [None])
                for direct in (directs if impl == "triton" else [None])
                for tile in (tiles if cnp == "fused" else [None])
                for graph in (graphs if impl == "triton" else [False])]
    has_orig = importlib.util.find_spec("poet_torch") is not None
    if not has_orig:
        print("note: the authors' poet_torch is not importable here; its rows are skipped")
    result["authors_importable"] = has_orig
    lw = (28 + 8 * (len(cnps) > 1) + 13 * (len(directs) > 1) + 9 * (len(tiles) > 1)
          + 8 * any(graphs))
    header = (f"{'layer':{lw}s} {'in':>5s} {'out':>5s} {'b':>4s} | {'eager ms':>8s} "
              f"{'x Lin':>5s} | {'piped ms':>8s} {'x Lin':>5s} | {'graph ms':>8s} {'x Lin':>5s} | "
              f"{'peak MiB':>8s} | {'launches':>8s} | {'host us':>7s} | {'held MiB':>8s}")
    print("eager: one call, synchronized (host launch time included); piped: calls back to "
          "back, one sync; graph: one CUDA-graph replay per call (GPU time alone); host us: "
          "the host's time per piped call")
    print(header)
    print("-" * len(header))

    def fmt(v, ref):
        return (f"{v:8.3f} {v / ref:5.2f}" if v is not None and ref
                else f"{'n/a':>8s} {'':5s}")

    for n_in, n_out in shapes:
        x = torch.randn(1, tokens, n_in, device=dev, dtype=dtype, requires_grad=True)
        g = torch.randn(1, tokens, n_out, device=dev, dtype=dtype)
        lin = nn.Linear(n_in, n_out, bias=False, device=dev, dtype=dtype)
        ref = measure(lin, x, g, args.iters, args.warmup)
        rows = [("nn.Linear", None, ref)]
        del lin
        for b in blocks:
            for impl, cnp, direct, tile, graph in variants:
                tag = impl if cnp is None or len(cnps) == 1 else f"{impl}, cnp={cnp}"
                if graph:
                    tag += ", graphs"
                if direct is not None and len(directs) > 1:
                    tag += f", direct={'on' if direct else 'off'}"
                if tile is not None:
                    tag += f", {'x'.join(map(str, tile))}"
                for var in ("fast", "mem"):
                    layer = POETLinear(n_in, n_out, b, variant=var, impl=impl, device=dev,
                                       dtype=dtype, cuda_graphs=graph)
                    with torch.no_grad():
                        layer.oft_R.normal_(0, 1e-3)
                    default, default_direct = K.BACKEND, poet_jit.ENABLED
                    default_tiles = dict(K.FUSED_TILES)
                    K.BACKEND = cnp or default
                    poet_jit.ENABLED = default_direct if direct is None else direct
                    if tile is not None:
                        K.FUSED_TILES["lowp"] = tile
                    try:
                        res = measure(layer, x, g, args.iters, args.warmup)
                        if graph:
                            from xopt.torch import poet_graphs

                            print(f"xopt {var} ({tag}) b={b}: {poet_graphs.stats(layer)}")
                            poet_graphs.clear(layer)
                    except Exception as e:  # keep the other rows
                        print(f"xopt {var} ({tag}) b={b}: {e!r}")
                        continue
                    finally:
                        K.BACKEND, poet_jit.ENABLED = default, default_direct
                        K.FUSED_TILES.update(default_tiles)
                    rows.append((f"xopt {var} ({tag})", b, res))
                    del layer
            for mem in (False, True):
                try:
                    orig = authors_layer(n_in, n_out, b, mem, dtype, dev)
                    if orig is not None:  # pragma: no cover - only where it is importable
                        with torch.no_grad():
                            orig.oft_R.normal_(0, 1e-3)
                        rows.append((f"authors POET-X {'mem' if mem else 'fast'}", b,
                                     measure(orig, x, g, args.iters, args.warmup, False)))
                        del orig
                except Exception as e:  # keep the other rows
                    print(f"authors POET-X {'mem' if mem else 'fast'} b={b}: {e!r}"[:400])
        for label, b, (t, m, pl, gr, nl, hu, held) in rows:
            print(f"{label:{lw}s} {n_in:5d} {n_out:5d} {b or '-':>4} | {fmt(t, ref[0])} | "
                  f"{fmt(pl, ref[2])} | {fmt(gr, ref[3])} | "
                  f"{m if m is not None else float('nan'):8.1f} | "
                  f"{_launches_text(nl):>8} | "
                  f"{f'{hu:7.0f}' if hu is not None else 'n/a':>7} | "
                  f"{f'{held:8.1f}' if held is not None else '':>8}", flush=True)
            result["rows"].append({
                "layer": label, "in": n_in, "out": n_out, "block_size": b, "ms": t,
                "ratio_to_linear": t / ref[0], "peak_mib": m, "pipelined_ms": pl,
                "pipelined_ratio": pl / ref[2] if pl is not None else None, "graph_ms": gr,
                "graph_ratio": gr / ref[3] if gr is not None and ref[3] else None,
                "launches": nl[0] if nl else None, "direct_launches": nl[1] if nl else None,
                "host_us": hu, "held_mib": held})
        if args.rounds and dev.type == "cuda":
            result.setdefault("side_by_side", []).extend(
                rounds_table(n_in, n_out, blocks, x, g, args.rounds, args.iters, dtype, dev))
        del x, g
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    summary(result["rows"])
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


def _launches_text(nl) -> str:
    """``21/7d``: 21 launches, 7 of them through poet_jit's direct path."""
    if nl is None:
        return "n/a"
    return f"{nl[0]}/{nl[1]}d" if nl[1] else str(nl[0])


def summary(rows: list) -> None:
    """The fast layers against nn.Linear of their shape: eager back to back (piped; the
    host's launches included) and graph (GPU time alone), and the launches."""
    lin = {(r["in"], r["out"]): r for r in rows if r["layer"] == "nn.Linear"}
    print("summary: fast layer / nn.Linear, eager back to back (piped) and CUDA graph; "
          "launches per forward+backward")
    for r in rows:
        ref = lin.get((r["in"], r["out"]))
        if "fast" not in r["layer"] or ref is None:
            continue
        piped = (f"{r['pipelined_ms']:.3f} / {ref['pipelined_ms']:.3f} ms = "
                 f"{r['pipelined_ratio']:.2f}x" if r["pipelined_ratio"] else "n/a")
        graph = (f"{r['graph_ms']:.3f} / {ref['graph_ms']:.3f} ms = {r['graph_ratio']:.2f}x"
                 if r["graph_ratio"] else "n/a")
        host = (f"; host {r['host_us']:.0f} us per call (nn.Linear {ref['host_us']:.0f})"
                if r.get("host_us") is not None and ref.get("host_us") is not None else "")
        print(f"  {r['layer']} {r['in']}x{r['out']} b={r['block_size']}: eager piped {piped}; "
              f"graph {graph}; launches {_launches_text((r['launches'], r['direct_launches']))}"
              f" (nn.Linear {ref['launches']}){host}",
              flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
