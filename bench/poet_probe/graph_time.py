"""``gtime(fn)``: GPU µs of one call of ``fn``, from a CUDA graph of ``reps`` calls replayed
(best of 3), so the host's launch cost is out of the figure."""

import torch


def gtime(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    best = []
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        best.append(a.elapsed_time(b) / reps * 1e3)
    del g
    return min(best)


def fwd_bwd(layer, x, gy):
    """A call of ``layer``'s forward and backward at ``x`` (cotangent ``gy``), its leaves'
    gradients dropped first (so no accumulation is timed)."""

    def f():
        x.grad = None
        for p in layer.parameters():
            p.grad = None
        layer(x).backward(gy)

    return f
