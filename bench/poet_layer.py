"""POET-X layer benchmark: forward+backward latency and peak memory of one layer.

    python bench/poet_layer.py [--out RESULTS.json] [--dtype bf16|fp32] [--check] [--tiny]

At LLaMA-8B-like shapes (4096×4096 and 4096→14336, block sizes 256 and 512, 4096 tokens)
it times, in one run: ``nn.Linear`` (the weight trained, as in AdamW pre-training), xopt's
``POETLinear`` fast and mem variants (``impl="triton"`` on CUDA: fused CNP and gather
kernels; ``impl="plain"`` too, to show what the kernels buy) and the authors' POET-X
(``poet_torch.POETLinear``) when it is importable. Latency: median of CUDA-event timings of
``y = layer(x); y.backward(g)`` after warm-up. Peak memory: ``max_memory_allocated``
during that call minus what was allocated before it (layer, input, cotangent), i.e. the
memory the forward/backward itself needs (activations kept for backward, gradients,
workspaces).

``--check`` first validates the kernels on the device against their PyTorch references
(float32) and runs the parity harness on the bundled POET traces with ``impl="triton"``.
``--tiny`` runs small shapes on the CPU (smoke test; timings meaningless).
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

from xopt.torch.poet import POETLinear  # noqa: E402


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def measure(layer: nn.Module, x: torch.Tensor, g: torch.Tensor, iters: int, warmup: int):
    dev = x.device

    def once():
        if x.grad is not None:
            x.grad = None
        for p in layer.parameters():
            p.grad = None
        layer(x).backward(g)

    for _ in range(warmup):
        once()
    _sync(dev)
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
    return statistics.median(times), peak


def authors_layer(n_in, n_out, b, mem, dtype, dev):
    if importlib.util.find_spec("poet_torch") is None:
        return None
    from poet_torch.layers.poet_linear import POETLinear as Orig  # pragma: no cover

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


def profile(dev, dtype, tokens) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    out = {}
    x = torch.randn(tokens, 4096, device=dev, dtype=dtype, requires_grad=True)
    g = torch.randn(tokens, 4096, device=dev, dtype=dtype)
    for var in ("fast", "mem"):
        layer = POETLinear(4096, 4096, 256, variant=var, impl="triton", device=dev, dtype=dtype)
        measure(layer, x, g, 3, 3)
        with prof(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as p:
            for _ in range(5):
                layer(x).backward(g)
            torch.cuda.synchronize()
        table = p.key_averages().table(sort_by="cuda_time_total", row_limit=22,
                                       max_name_column_width=60)
        print(f"--- profile: xopt {var} (triton), 4096x4096, b=256, 5 fwd+bwd ---")
        print(table)
        out[var] = table
    return out


def _cuda_ms(fn, iters=50, warmup=5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters


def micro(dev, dtype, tokens) -> dict:
    """The pieces: permutation kernels (each MODE, a copy as the floor), the CNP
    backends (forward+backward), and the whole fast layer under each combination."""
    from xopt.kernels import poet_cayley as K
    from xopt.kernels import poet_perm as PP

    out = {}
    for d in (4096, 14336):
        x = torch.randn(tokens, d, device=dev, dtype=dtype)
        p = torch.randperm(d, device=dev).to(torch.int32)
        out[f"copy_{d}_us"] = 1e3 * _cuda_ms(lambda x=x: x.clone())
        for mode in ("torch", "tiled", "rowloop"):
            PP.MODE = mode
            try:
                out[f"gather_{mode}_{d}_us"] = 1e3 * _cuda_ms(lambda x=x, p=p: PP.gather(x, p))
            except Exception as e:
                out[f"gather_{mode}_{d}_us"] = repr(e)[:200]
            print(f"micro gather_{mode}_{d}_us: {out[f'gather_{mode}_{d}_us']}", flush=True)
        PP.MODE = "auto"
    for b, n in ((256, 32), (512, 16), (256, 72)):
        x = ((0.3 / b**0.5) * torch.randn(n, b * (b - 1) // 2, device=dev)).requires_grad_()
        gr = torch.randn(n, b, b, device=dev)
        for backend in ("triton", "bmm"):
            def step(backend=backend, x=x, gr=gr, b=b):
                x.grad = None
                K.cayley_neumann(x, b, tf32=True, backend=backend).backward(gr)
            out[f"cnp_{backend}_n{n}_b{b}_fwdbwd_us"] = 1e3 * _cuda_ms(step, 20)
            print(f"micro cnp_{backend}_n{n}_b{b}_fwdbwd_us: "
                  f"{out[f'cnp_{backend}_n{n}_b{b}_fwdbwd_us']}", flush=True)
    x = torch.randn(tokens, 4096, device=dev, dtype=dtype, requires_grad=True)
    g = torch.randn(tokens, 4096, device=dev, dtype=dtype)
    for backend in ("bmm", "triton"):
        for mode in ("auto",):
            K.BACKEND, PP.MODE = backend, mode
            for var in ("fast", "mem"):
                layer = POETLinear(4096, 4096, 256, variant=var, impl="triton", device=dev,
                                   dtype=dtype)
                out[f"layer_{var}_{backend}_{mode}_ms"] = measure(layer, x, g, 20, 5)[0]
                print(f"micro layer_{var}_{backend}_{mode}_ms: "
                      f"{out[f'layer_{var}_{backend}_{mode}_ms']}", flush=True)
    K.BACKEND, PP.MODE = "bmm", "auto"
    out["perm_modes_chosen"] = {str(k): v for k, v in PP._chosen.items()}
    print("micro perm modes chosen by auto:", out["perm_modes_chosen"], flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write results as JSON here")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--check", action="store_true", help="validate kernels and parity first")
    ap.add_argument("--tiny", action="store_true", help="small CPU smoke run")
    ap.add_argument("--profile", action="store_true",
                    help="print torch.profiler's per-kernel CUDA times of xopt fast and mem "
                         "(triton, 4096x4096, b=256)")
    ap.add_argument("--micro", action="store_true",
                    help="time the pieces (permutation modes, CNP backends) first")
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
    if args.micro and dev.type == "cuda":
        result["micro"] = micro(dev, dtype, args.tokens)
    if args.profile and dev.type == "cuda":
        result["profile"] = profile(dev, dtype, args.tokens)
    if args.tiny:
        shapes, blocks, tokens, impls = [(64, 64), (64, 128)], [16, 32], 64, ["plain"]
        args.iters, args.warmup = 2, 1
    else:
        shapes, blocks, tokens = [(4096, 4096), (4096, 14336)], [256, 512], args.tokens
        impls = ["triton", "plain"] if dev.type == "cuda" else ["plain"]
    has_orig = importlib.util.find_spec("poet_torch") is not None
    if not has_orig:
        print("note: the authors' poet_torch is not importable here; its rows are skipped")
    result["authors_importable"] = has_orig
    header = (f"{'layer':34s} {'in':>6s} {'out':>6s} {'b':>4s} {'ms fwd+bwd':>11s} "
              f"{'x Linear':>9s} {'peak MiB':>9s}")
    print(header)
    print("-" * len(header))
    for n_in, n_out in shapes:
        x = torch.randn(tokens, n_in, device=dev, dtype=dtype, requires_grad=True)
        g = torch.randn(tokens, n_out, device=dev, dtype=dtype)
        lin = nn.Linear(n_in, n_out, bias=False, device=dev, dtype=dtype)
        t_lin, m_lin = measure(lin, x, g, args.iters, args.warmup)
        rows = [("nn.Linear", None, t_lin, m_lin)]
        del lin
        for b in blocks:
            for impl in impls:
                for var in ("fast", "mem"):
                    layer = POETLinear(n_in, n_out, b, variant=var, impl=impl, device=dev,
                                       dtype=dtype)
                    with torch.no_grad():
                        layer.oft_R.normal_(0, 1e-3)
                    try:
                        t, m = measure(layer, x, g, args.iters, args.warmup)
                    except Exception as e:  # keep the other rows
                        print(f"xopt {var} ({impl}) b={b}: {e!r}")
                        continue
                    rows.append((f"xopt {var} ({impl})", b, t, m))
                    del layer
            for mem in (False, True):
                orig = authors_layer(n_in, n_out, b, mem, dtype, dev)
                if orig is not None:  # pragma: no cover - not installed on our machines
                    t, m = measure(orig, x, g, args.iters, args.warmup)
                    rows.append((f"authors POET-X {'mem' if mem else 'fast'}", b, t, m))
        for label, b, t, m in rows:
            print(f"{label:34s} {n_in:6d} {n_out:6d} {b or '-':>4} {t:11.3f} "
                  f"{t / t_lin:9.2f} {m if m is not None else float('nan'):9.1f}")
            result["rows"].append({"layer": label, "in": n_in, "out": n_out, "block_size": b,
                                   "ms": t, "ratio_to_linear": t / t_lin, "peak_mib": m})
        del x, g
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
