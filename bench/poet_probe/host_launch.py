"""Where the host time of the fast layer's forward+backward goes, and what a Triton launch
costs through ``kernel[grid](...)`` against the compiled kernel's own launcher.

    PYTHONPATH=$PWD python3 bench/poet_probe/host_launch.py

On one CUDA GPU, bf16, 4096², b = 256, 256 tokens (so the GPU waits on the host):

1. host µs per launch of the rowloop gather: ``kernel[grid](...)`` against the compiled
   kernel's launcher called directly (each checked against ``index_select``);
2. host µs per call of each piece of the fast layer and of its forward+backward (twice),
   nn.Linear's forward+backward beside them;
3. a cProfile of the layer's forward+backward (own time);
4. :func:`breakdown`: host µs per forward+backward inside each piece, and outside them
   (twice).
"""

import sys
import time
from pathlib import Path

import torch
import triton
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from poet_layer import cprofile_fwd_bwd  # noqa: E402

from xopt.kernels import poet_perm as PP  # noqa: E402
from xopt.torch.poet import POETLinear  # noqa: E402


def per_call_us(fn, n=300):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    best = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return min(best)


def _direct(kernel, grid, args, constexprs, num_warps):
    """The compiled kernel's own launcher, as ``CompiledKernel.__getitem__``'s runner calls
    it (Triton 3.6/3.9), for an already compiled specialization (no key, no checks: a
    measurement only; xopt does not launch this way)."""
    from triton import knobs
    from triton.runtime import driver

    ck = kernel[grid](*args, num_warps=num_warps, **constexprs)
    ck._init_handles()
    g = tuple(grid) + (1,) * (3 - len(grid))
    full = tuple(args) + tuple(constexprs.values())
    dev = torch.cuda.current_device()

    def go():
        stream = driver.active.get_current_stream(dev)
        ck.run(g[0], g[1], g[2], stream, ck.function, ck.packed_metadata,
               ck.launch_metadata(g, stream, *full), knobs.runtime.launch_enter_hook,
               knobs.runtime.launch_exit_hook, *full)
    return go


def launches():
    """Host µs per launch of the rowloop gather: ``kernel[grid]`` against the compiled
    kernel's launcher called directly (both checked against ``index_select``)."""
    dev = torch.device("cuda")
    n, d = 64, 4096
    x = torch.randn(n, d, device=dev, dtype=torch.bfloat16)
    idx = torch.randperm(d, device=dev).to(torch.int32)
    out = torch.empty_like(x)
    ref = x.index_select(-1, idx.long())
    k = PP._perm_rowloop_kernel
    args = (x, idx, out, n, d, x.stride(0), out.stride(0))
    cx = dict(ROWS=1, BLOCK_D=4096)
    res = {}
    for label, fn in (("kernel[grid]", lambda: k[(n,)](*args, num_warps=4, **cx)),
                      ("direct launcher", _direct(k, (n,), args, cx, 4))):
        out.zero_()
        fn()
        torch.cuda.synchronize()
        assert torch.equal(out, ref), label
        res[label] = per_call_us(fn)
    res["torch.empty"] = per_call_us(lambda: torch.empty_like(x))
    res["x + x"] = per_call_us(lambda: x + x)
    for k_, v in res.items():
        print(f"host per call: {k_:24s} {v:8.2f} us")


def pieces():
    """Host µs per call of each piece of the fast layer's forward+backward at 256 tokens
    (bf16, 4096², b = 256)."""
    from xopt.kernels import poet_cayley as K
    from xopt.torch import poet as TP

    dev, dt = torch.device("cuda"), torch.bfloat16
    x = torch.randn(1, 256, 4096, device=dev, dtype=dt, requires_grad=True)
    g = torch.randn(1, 256, 4096, device=dev, dtype=dt)
    layer = POETLinear(4096, 4096, 256, variant="fast", impl="triton", device=dev, dtype=dt)
    x2d = x.detach().reshape(-1, 4096)
    r = torch.randn(16, 256, 256, device=dev, dtype=dt)
    perm = layer.perm_in
    grad_r = torch.empty(32, 256, 256, device=dev, dtype=dt)
    oft = layer.oft_R.detach()
    y, saved = K.blocks_forward(oft, 256, "product", True, "bmm", dt)
    res = {
        "gather": lambda: TP._gather(x2d, perm, True),
        "rotate": lambda: TP._rotate(x2d, r),
        "rotate^T": lambda: TP._rotate(x2d, r, transpose=True),
        "outer(out=)": lambda: TP._outer(x2d, x2d, 16, out=grad_r[:16]),
        "linear": lambda: nn.functional.linear(x2d, layer.weight),
        "blocks_forward": lambda: K.blocks_forward(oft, 256, "product", True, "bmm", dt),
        "blocks_backward": lambda: K.blocks_backward(saved, y, 256, "product", True, "bmm",
                                                     dt),
    }
    res = {k: per_call_us(f, 200) for k, f in res.items()}

    def fwd():
        layer(x)

    def fwd_bwd():
        x.grad = None
        layer.oft_R.grad = None
        layer(x).backward(g)

    res["forward (grad)"] = per_call_us(fwd, 100)
    res["forward+backward"] = per_call_us(fwd_bwd, 100)
    line = ", ".join(f"{k} {v:.1f}" for k, v in res.items())
    print(f"pieces, host us: {line}", flush=True)
    return layer, x, g


def layer_host():
    dev = torch.device("cuda")
    dt = torch.bfloat16
    x = torch.randn(1, 256, 4096, device=dev, dtype=dt, requires_grad=True)
    g = torch.randn(1, 256, 4096, device=dev, dtype=dt)
    lin = nn.Linear(4096, 4096, bias=False, device=dev, dtype=dt)

    def call():
        x.grad = None
        lin(x).backward(g)
    print(f"host per fwd+bwd (256 tokens): nn.Linear {per_call_us(call, 100):8.1f} us")
    for _ in range(2):
        layer, x, g = pieces()
    cprofile_fwd_bwd(layer, x, g, 100, "xopt fast, 100 fwd+bwd, own time", 25)



def breakdown(rounds: int = 200):
    """Host µs per fwd+bwd spent inside each piece (timing wrappers around the layer's
    helpers and its autograd Function's forward and backward bodies), and the rest: the
    autograd machinery around them."""
    from collections import defaultdict

    from xopt.kernels import poet_cayley as K
    from xopt.torch import poet as TP

    acc = defaultdict(float)

    def wrap(name, fn):
        def w(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[name] += time.perf_counter() - t0
        return w

    saved = {n: getattr(TP, n) for n in ("_gather", "_rotate", "_outer")}
    saved_k = {n: getattr(K, n) for n in ("blocks_forward", "blocks_backward")}
    fwd, bwd = TP._Chain.forward, TP._Chain.backward
    try:
        for n, f in saved.items():
            setattr(TP, n, wrap(n, f))
        for n, f in saved_k.items():
            setattr(K, n, wrap(n, f))
        TP._Chain.forward = staticmethod(wrap("Chain.forward body", fwd))
        TP._Chain.backward = staticmethod(wrap("Chain.backward body", bwd))
        dev, dt = torch.device("cuda"), torch.bfloat16
        x = torch.randn(1, 256, 4096, device=dev, dtype=dt, requires_grad=True)
        g = torch.randn(1, 256, 4096, device=dev, dtype=dt)
        layer = POETLinear(4096, 4096, 256, variant="fast", impl="triton", device=dev,
                           dtype=dt)
        for _ in range(20):
            x.grad = layer.oft_R.grad = None
            layer(x).backward(g)
        torch.cuda.synchronize()
        acc.clear()
        t_fwd = t_all = 0.0
        for _ in range(rounds):
            x.grad = layer.oft_R.grad = None
            t0 = time.perf_counter()
            y = layer(x)
            t1 = time.perf_counter()
            y.backward(g)
            t2 = time.perf_counter()
            t_fwd += t1 - t0
            t_all += t2 - t0
        torch.cuda.synchronize()
    finally:
        for n, f in saved.items():
            setattr(TP, n, f)
        for n, f in saved_k.items():
            setattr(K, n, f)
        TP._Chain.forward, TP._Chain.backward = staticmethod(fwd), staticmethod(bwd)
    us = {k: v / rounds * 1e6 for k, v in acc.items()}
    print(f"breakdown, host us per fwd+bwd (wrappers on): total {t_all / rounds * 1e6:.1f}, "
          f"layer(x) {t_fwd / rounds * 1e6:.1f}, backward() "
          f"{(t_all - t_fwd) / rounds * 1e6:.1f}; " + ", ".join(f"{k} {v:.1f}"
                                                                for k, v in us.items()))


if __name__ == "__main__":
    print("triton", triton.__version__, "torch", torch.__version__)
    launches()
    layer_host()
    for _ in range(2):
        breakdown()
