"""POETLinear(cuda_graphs=True): graphed calls give the eager layer's results, bit for bit.

On the CPU the capture backend is substituted by one that records the graph's function and
re-runs it at each replay, copying into the captured outputs (what a replay does to a
graph's static outputs) and failing if a tensor the graph reads by address was replaced
(what a real replay would silently get wrong); the Triton kernels run under the
interpreter. The ``cuda`` tests run the real CUDA graphs."""

from __future__ import annotations

import pytest
from helpers import needs_torch

pytestmark = needs_torch

torch = pytest.importorskip("torch")

from helpers import triton_kernel_target  # noqa: E402

needs_triton, DEV = triton_kernel_target()


class ReplayOnHost:
    """A capture backend for the CPU (module docstring)."""

    def available(self, device):
        return True

    def capture(self, fn, reads, device):
        fn()  # the warm-up, as the CUDA backend does
        outs = fn()
        refs = list(reads)
        ptrs = [t.data_ptr() for t in refs]

        def replay():
            assert [t.data_ptr() for t in refs] == ptrs, "a graph whose inputs moved replayed"
            _copy(outs, fn())

        return outs, replay


def _copy(dst, src):
    if isinstance(dst, torch.Tensor):
        if dst is not src:
            dst.copy_(src)
    elif isinstance(dst, (tuple, list)):
        for d, s in zip(dst, src, strict=True):
            _copy(d, s)


@pytest.fixture
def host_graphs(monkeypatch):
    from xopt.kernels import poet_perm
    from xopt.torch import poet_graphs

    monkeypatch.setattr(poet_graphs, "BACKEND", ReplayOnHost())
    if DEV.type == "cpu":  # (the gathers as torch ops: the interpreter's time is the CI's)
        monkeypatch.setattr(poet_perm, "MODE", "torch")
    return poet_graphs


def _pair(variant="fast", bias=True, dtype=torch.float32, device=None, n_in=16, n_out=24,
          b=8, **kw):
    from xopt.torch.poet import POETLinear

    device = device or DEV
    torch.manual_seed(3)
    eager = POETLinear(n_in, n_out, b, bias=bias, bias_requires_grad=bias, variant=variant,
                       impl="triton", device=device, dtype=dtype, **kw)
    with torch.no_grad():  # (a layer's W0 is uninitialised memory until set)
        eager.set_w0(torch.randn(n_out, n_in, device=device).to(dtype) * 0.1)
        eager.oft_R.normal_(0, 0.05)
        if bias:
            eager.bias.normal_()
    graphed = POETLinear(n_in, n_out, b, bias=bias, bias_requires_grad=bias, variant=variant,
                         impl="triton", device=device, dtype=dtype, cuda_graphs=True, **kw)
    graphed.load_state_dict(eager.state_dict())
    return eager, graphed


def _call(layer, x, g):
    """``(y, x.grad, oft_R.grad, bias.grad)`` of one forward+backward (grads cleared)."""
    xx = x.detach().clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    y = layer(xx)
    y.backward(g)
    bias = layer.bias.grad.clone() if layer.bias is not None else None
    return y.detach().clone(), xx.grad.clone(), layer.oft_R.grad.clone(), bias


def _same(a, b):
    for u, v in zip(a, b, strict=True):
        # (finite first: NaN is never equal to itself, and a diverging schedule is the
        # test's fault, not the graphs')
        assert u is None or bool(torch.isfinite(u).all()), "the eager layer went non-finite"
        assert (u is None and v is None) or torch.equal(u, v)


def _step(layer, lr=1e-3):
    with torch.no_grad():  # in place, as an optimizer updates
        layer.oft_R.add_(layer.oft_R.grad, alpha=-lr)
        if layer.bias is not None:
            layer.bias.add_(layer.bias.grad, alpha=-lr)


def _run_schedule(eager, graphed, shapes, dtype, steps=3, lr=1e-3):
    """Steps with in-place updates, a merge, a second shape, a no_grad call: every output
    and gradient equal; returns the graphed layer's stats."""
    from xopt.torch import poet_graphs

    dev = eager.oft_R.device
    for s, shape in enumerate(shapes):
        for i in range(steps):
            torch.manual_seed(10 * s + i)
            x = torch.randn(*shape, eager.in_features, device=dev, dtype=dtype)
            g = torch.randn(*shape, eager.out_features, device=dev, dtype=dtype)
            _same(_call(eager, x, g), _call(graphed, x, g))
            _step(eager, lr)
            _step(graphed, lr)
            if i == 1:
                eager.merge_and_reset()
                graphed.merge_and_reset()
        with torch.no_grad():
            assert torch.equal(eager(x), graphed(x))
    return poet_graphs.stats(graphed)


@needs_triton
@pytest.mark.parametrize("variant", ["fast", "mem"])
def test_graphed_layer_is_the_eager_layer_bit_for_bit(host_graphs, variant):
    """Over steps with in-place updates, a merge (in place: no recapture), two input shapes
    (one capture each, at the second call) and no_grad calls (the forward graph alone)."""
    eager, graphed = _pair(variant)
    shapes = [(2, 3), (5,)] if variant == "fast" else [(2, 3)]
    st = _run_schedule(eager, graphed, shapes, torch.float32)
    # per shape: the first call eager, the second captures; merges do not recapture
    n = len(shapes)
    assert st == {"captures": n, "eager": n, "replays": n * (2 * 2 + 1)}


@needs_triton
def test_a_replaced_tensor_drops_the_graphs(host_graphs):
    """``.data`` replaced or ``load_state_dict(assign=True)``: the next call captures afresh
    (the host backend fails on a replay that reads a moved tensor)."""
    eager, graphed = _pair()
    x = torch.randn(4, 16, device=DEV)
    g = torch.randn(4, 24, device=DEV)
    for _ in range(2):
        _same(_call(eager, x, g), _call(graphed, x, g))
    assert host_graphs.stats(graphed)["captures"] == 1
    with torch.no_grad():
        eager.oft_R.normal_(0, 0.05)
    graphed.oft_R.data = eager.oft_R.detach().clone()
    for _ in range(2):
        _same(_call(eager, x, g), _call(graphed, x, g))
    graphed.load_state_dict(eager.state_dict(), assign=True)
    for _ in range(2):
        _same(_call(eager, x, g), _call(graphed, x, g))
    st = host_graphs.stats(graphed)
    assert st["captures"] == 3 and st["eager"] == 3


@needs_triton
def test_a_call_awaiting_its_backward_keeps_its_activations(host_graphs):
    """The same layer twice in one forward: the second call runs eagerly (the first's
    saved activations are in the graph's buffers), and the gradients are the eager
    layer's."""
    eager, graphed = _pair(n_in=16, n_out=16)
    x = torch.randn(3, 16, device=DEV)
    g = torch.randn(3, 16, device=DEV)
    res = []
    # the graphed layer's first run: its first call eager, its second captured and replayed;
    # its second run: the first call replayed, the second (the first's pending) eager
    for layer in (eager, graphed, graphed):
        layer.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_()
        y = layer(layer(xx))
        y.backward(g)
        res.append((y.detach(), xx.grad, layer.oft_R.grad.clone(), layer.bias.grad.clone()))
    _same(res[0], res[2])
    st = host_graphs.stats(graphed)
    assert st == {"captures": 1, "replays": 4, "eager": 2}


@needs_triton
def test_backward_after_a_later_call_replaced_the_activations_raises(host_graphs):
    eager, graphed = _pair()
    x = torch.randn(4, 16, device=DEV, requires_grad=True)
    g = torch.randn(4, 24, device=DEV)
    graphed(x).backward(g)
    y = graphed(x)  # graphed
    y.backward(g, retain_graph=True)
    y.backward(g, retain_graph=True)  # nothing ran in between: the buffers are its own
    graphed(x).sum().backward()
    with pytest.raises(RuntimeError, match="saved activations were replaced"):
        y.backward(g, retain_graph=True)
    # a call whose graph was dropped unused frees the buffers: a no_grad call replays, and
    # so does the next call with grad, whose backward is then its own
    z = graphed(x)
    del z
    with torch.no_grad():
        graphed(x)
    _same(_call(eager, x, g), _call(graphed, x, g))
    with pytest.raises(RuntimeError, match="saved activations were replaced"):
        y.backward(g)
    assert host_graphs.stats(graphed)["eager"] == 1  # (the first call only)


@needs_triton
def test_graphs_stand_aside_where_they_cannot_serve(host_graphs):
    """Under autocast, with an empty input, and without a backend that can capture on the
    device, the layer runs eagerly (counted), with the eager results."""
    from xopt.torch.poet_graphs import CudaGraphs

    eager, graphed = _pair()
    x = torch.randn(4, 16, device=DEV)
    cnp = (8, "product", False, torch.float32, "bmm")
    with torch.autocast(DEV.type, enabled=True):
        for _ in range(2):
            assert host_graphs.forward(graphed, x, cnp) is None
    assert graphed(x[:0]).shape == (0, 24)
    st = host_graphs.stats(graphed)
    assert st == {"captures": 0, "replays": 0, "eager": 3}
    # the layer's own calls under autocast come with it off, in autocast's dtype: served,
    # with the eager layer's results under autocast
    g = torch.randn(4, 24, device=DEV, dtype=torch.bfloat16)
    for _ in range(2):
        with torch.autocast(DEV.type, dtype=torch.bfloat16):
            got, want = _call(graphed, x, g), _call(eager, x, g)
        _same(got, want)
    st = host_graphs.stats(graphed)
    assert st["captures"] == 1 and st["replays"] == 2  # (the second call: both ways)
    host_graphs.clear(graphed)
    if DEV.type == "cpu":
        host_graphs.BACKEND = CudaGraphs()
        for _ in range(2):
            assert torch.equal(graphed(x), eager(x))
        assert host_graphs.stats(graphed)["captures"] == 0


@needs_triton
def test_a_graphed_call_launches_only_its_gathers(monkeypatch):
    """The host's work per graphed forward+backward (the CPU-countable proxy of its eager
    time): the four permutation gathers, the gradients' accumulation into ``oft_R.grad`` and
    ``bias.grad``, and two graph replays, against ~21 launches of the eager layer."""
    from xopt.kernels.poet_launches import count_launches
    from xopt.torch import poet_graphs

    replays = []

    class Counting(ReplayOnHost):
        def capture(self, fn, reads, device):
            return fn(), lambda: replays.append(1)

    monkeypatch.setattr(poet_graphs, "BACKEND", Counting())
    _, graphed = _pair()
    x = torch.randn(8, 16, device=DEV, requires_grad=True)
    g = torch.randn(8, 24, device=DEV)

    def once():
        x.grad = None
        graphed(x).backward(g)

    once()
    once()  # (captured here)
    replays.clear()
    c = count_launches(once)
    assert sum(c.triton.values()) == 4 and set(c.triton) <= {"_perm_smem_kernel",
                                                             "_perm_rowloop_kernel"}
    assert sum(c.aten.values()) == 2  # the two gradients added into .grad
    assert len(replays) == 2


def test_cuda_graphs_flag_is_checked_and_passed_on_by_convert():
    from torch import nn

    from xopt.errors import HyperparameterError
    from xopt.torch.poet import POETLinear, convert

    with pytest.raises(HyperparameterError, match="cuda_graphs"):
        POETLinear(32, 32, 16, cuda_graphs="yes")
    model, n = convert(nn.Sequential(nn.Linear(32, 32)), 16, cuda_graphs=True, impl="plain")
    assert n == 1 and model[0].cuda_graphs and "cuda_graphs=True" in repr(model)


# -- on a GPU: the real graphs ---------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("variant,dtype,kw", [
    ("fast", torch.bfloat16, {}), ("mem", torch.bfloat16, {}), ("fast", torch.float32, {}),
    ("mem", torch.bfloat16, dict(weight_bits=8, weight_group_size=64)),
], ids=["fast-bf16", "mem-bf16", "fast-fp32", "xq-bf16"])
def test_cuda_graphed_layer_is_the_eager_layer_bit_for_bit(variant, dtype, kw):
    eager, graphed = _pair(variant, dtype=dtype, device=torch.device("cuda"), n_in=256,
                           n_out=512, b=64, **kw)
    # (at these sizes a step of 1e-3 diverges: oft_R's gradient reaches 3e4 after the merge
    # and the fifth call is NaN on both sides, eager and graphed alike; 1e-5 stays finite)
    st = _run_schedule(eager, graphed, [(2, 64), (96,)], dtype, lr=1e-5)
    assert st["captures"] == 2 and st["replays"] == 10


@pytest.mark.cuda
@cuda
def test_cuda_graphed_model_shares_buffers_and_matches_eager():
    """Two graphed layers of one shape in a model (their transient buffers shared), trained
    a few steps by POETAdamW with a merge: the eager model's losses and parameters."""
    from torch import nn

    from xopt.torch.poet import POETAdamW, convert, poet_param_groups

    def build(graphs):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 128)).cuda()
        m = m.to(torch.bfloat16)
        convert(m, 32, cuda_graphs=graphs, exclude_modules=())
        opt = POETAdamW(poet_param_groups(m, lr=1e-2, poet_lr=1e-2), model=m,
                        merge_interval=3)
        return m, opt

    runs = []
    for graphs in (False, True):
        m, opt = build(graphs)
        losses = []
        for i in range(7):
            torch.manual_seed(100 + i)
            x = torch.randn(16, 128, device="cuda", dtype=torch.bfloat16)
            loss = m(x).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        runs.append((torch.stack(losses), [p.detach().clone() for p in m.parameters()],
                     [b.clone() for b in m.buffers()]))
    assert torch.equal(runs[0][0], runs[1][0])
    for u, v in zip(runs[0][1] + runs[0][2], runs[1][1] + runs[1][2], strict=True):
        assert torch.equal(u, v)
