"""POETLinear under ``torch.compile`` of a whole model, and under autocast.

A model whose POET layers have several shapes compiles without a recompilation per layer
shape, and its compiled forward+backward gives the eager model's bits: the triton path
(under ``TRITON_INTERPRET=1`` on the CPU) is one graph with one opaque operator call per
layer call (``xopt::poet_chain`` and its backward, :mod:`xopt.torch.poet`), no graph
break; the plain path runs eagerly behind a graph break per call (its reference backward is
autograd's), its frame compiled at most twice (static, then dynamic shapes) however many
widths the layers have. The outputs are the last layer's (no reduction after it, which
inductor would compute in its own order), so the comparison is exact.
"""

from __future__ import annotations

import pytest
from helpers import has_torch, needs_triton

if has_torch:
    import torch
    from torch._dynamo.utils import counters
DEV = "cuda" if has_torch and torch.cuda.is_available() else "cpu"


def _model(widths, impl, variant, device="cpu", dtype=None, bias=True):
    """Linear layers ``widths[0] → widths[1] → …`` (ReLUs between) converted to POET with
    random rotations; the first layer has a trained bias."""
    from torch import nn

    from xopt.torch import poet as xpoet

    torch.manual_seed(0)
    mods = []
    for i, (a, b) in enumerate(zip(widths, widths[1:], strict=False)):
        mods += [nn.Linear(a, b, bias=bias and i == 0), nn.ReLU()]
    model = nn.Sequential(*mods[:-1]).to(device=device, dtype=dtype)
    xpoet.convert(model, block_size=16, variant=variant, impl=impl, bias_requires_grad=True)
    with torch.no_grad():
        for layer in xpoet.poet_layers(model):
            layer.oft_R.normal_(0, 0.1)
    return model


def _run(model, x, g, steps=2):
    """Forward+backward ``steps`` times (the second call runs what the first compiled);
    the last output, the input's gradient and every trained parameter's gradient."""
    for _ in range(steps):
        torch.compiler.cudagraph_mark_step_begin()  # (reduce-overhead: a new iteration)
        for p in model.parameters():
            p.grad = None
        xx = x.clone().requires_grad_()
        y = model(xx)
        y.backward(g)
    return [y.detach(), xx.grad] + [p.grad for p in model.parameters() if p.requires_grad]


def _compiled(model, backend, graphs=None):
    """``torch.compile(model, backend=backend)`` with dynamo's state and counters reset;
    ``graphs``: a list that receives each FX graph dynamo hands to the backend."""
    torch._dynamo.reset()
    counters.clear()
    if graphs is not None:
        inner = torch._dynamo.lookup_backend(backend)

        def backend(gm, example_inputs):
            graphs.append(gm)
            return inner(gm, example_inputs)
    return torch.compile(model, backend=backend)


def _calls(graphs, op):
    return sum(node.target is op for gm in graphs for node in gm.graph.nodes)


def _same(got, want):
    assert len(got) == len(want)
    for u, v in zip(got, want, strict=True):
        assert u.dtype == v.dtype and u.shape == v.shape
        assert torch.equal(u, v)


def _mixed_model():
    """Triton-path layers of two shapes and of each kind: fast 32→48 with a trained bias,
    mem 48→32, POET-XQ (``W0`` as 8-bit codes, mem) 32→48; ReLUs between."""
    from torch import nn

    from xopt.torch.poet import POETLinear

    torch.manual_seed(1)
    kinds = [((32, 48), dict(variant="fast", bias_requires_grad=True)),
             ((48, 32), dict(variant="mem")),
             ((32, 48), dict(variant="mem", weight_bits=8, weight_group_size=32))]
    layers = [POETLinear.from_linear(nn.Linear(*shape, bias=i == 0), 16, impl="triton",
                                     seed=i, **kw) for i, (shape, kw) in enumerate(kinds)]
    with torch.no_grad():
        for layer in layers:
            layer.oft_R.normal_(0, 0.1)
    return nn.Sequential(layers[0], nn.ReLU(), layers[1], nn.ReLU(), layers[2])


@needs_triton
@pytest.mark.parametrize("batched", [False, True])
def test_compiled_triton_path_is_one_graph_with_the_eager_bits(batched):
    """Layers of two shapes, fast, mem and POET-XQ, a bias, a 3-d input: one graph, no
    graph break, no recompilation (``error_on_recompile``), and the eager model's outputs
    and gradients bit for bit (``aot_eager``: dynamo, the fake implementations and
    AOTAutograd; the GPU test below runs inductor); ``batched``: with
    :func:`batch_rotations` on both models (the fast and mem layers' series in one
    ``xopt::poet_blocks`` call, their blocks passed to their operators for that forward
    only; POET-XQ's evaluates its own)."""
    from xopt.torch.poet import batch_rotations

    x = torch.randn(2, 5, 32)
    g = torch.randn(2, 5, 48)
    eager, model = _mixed_model(), _mixed_model()
    if batched:
        batch_rotations(eager)
        batch_rotations(model)
    want = _run(eager, x, g, steps=1)
    graphs = []
    compiled = _compiled(model, "aot_eager", graphs)
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = _run(compiled, x, g)
    _same(got, want)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1 == len(graphs)
    assert counters["frames"]["total"] == 1
    assert _calls(graphs, torch.ops.xopt.poet_chain.default) == 3
    assert _calls(graphs, torch.ops.xopt.poet_blocks.default) == int(batched)
    # the blocks ride on the layers for one forward only
    assert all(getattr(m, "_poet_batched", None) is None for m in model)


@pytest.mark.skipif(not has_torch, reason="needs torch")
@pytest.mark.parametrize("variant", ["fast", "mem"])
def test_compiled_plain_path_keeps_autograds_bits_without_a_compile_per_shape(variant):
    """The plain path (the CPU's, and the reference) runs eagerly behind a graph break per
    layer call: the eager bits; the layer's frame is compiled as often for four widths as
    for two (a recompilation per layer shape would add one per width)."""
    frames = []
    for widths in ((32, 48, 32, 48), (32, 48, 64, 16, 80, 32)):
        x = torch.randn(3, widths[0])
        g = torch.randn(3, widths[-1])
        want = _run(_model(widths, "plain", variant), x, g, steps=1)
        compiled = _compiled(_model(widths, "plain", variant), "aot_eager")
        _same(_run(compiled, x, g), want)
        reasons = list(counters["graph_break"])
        assert reasons and all("_plain_outside_graph" in r for r in reasons), reasons
        frames.append(counters["frames"]["total"])
    assert frames[0] == frames[1], frames


@needs_triton
@pytest.mark.parametrize("impl", ["plain", "triton"])
@pytest.mark.parametrize("variant", ["fast", "mem"])
def test_autocast_runs_the_layer_in_autocasts_dtype(impl, variant):
    """Under autocast the layer is the layer for an input in autocast's dtype (its
    rotations made in float32, W0 cast; the chain's preallocated products cannot be
    recast by autocast, which made them fail): the same bits, the input's gradient that
    one cast back; and it is that dtype's approximation of the float32 layer."""
    from xopt.torch.poet import POETLinear

    torch.manual_seed(2)
    layer = POETLinear(32, 48, 16, bias=True, bias_requires_grad=True, variant=variant,
                       impl=impl)
    with torch.no_grad():
        layer.oft_R.normal_(0, 0.1)
        layer.bias.normal_()
    x = torch.randn(2, 3, 32)
    g = torch.randn(2, 3, 48, dtype=torch.bfloat16)
    res = []
    for mode in ("autocast", "bf16", "fp32"):
        layer.zero_grad()
        xx = (x.to(torch.bfloat16) if mode == "bf16" else x).clone().requires_grad_()
        if mode == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = layer(xx)
        else:
            y = layer(xx)
        y.backward(g.to(y.dtype))
        res.append((y.detach(), xx.grad, layer.oft_R.grad.clone(), layer.bias.grad.clone()))
    (ya, gxa, gra, gba), (yb, gxb, grb, gbb), (yf, *_) = res
    assert ya.dtype == torch.bfloat16 and gxa.dtype == torch.float32
    assert torch.equal(ya, yb) and torch.equal(gxa, gxb.float())
    assert torch.equal(gra, grb) and torch.equal(gba, gbb)
    assert (ya.float() - yf).abs().max() <= 3e-2 * yf.abs().max()
    if impl == "triton":  # the chain's backward inside the region (CPU: the same thread)
        layer.zero_grad()
        xx = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            layer(xx).backward(g)
        assert torch.equal(xx.grad, gxa) and torch.equal(layer.oft_R.grad, gra)


@needs_triton
@pytest.mark.parametrize("backend", ["fused", "bmm", "triton"])
@pytest.mark.parametrize("formula", ["product", "taylor"])
def test_blocks_saved_layout_is_what_blocks_forward_saves(backend, formula):
    """The compiled operator's fake implementation declares the series' saved tensors from
    :func:`xopt.kernels.poet_cayley.blocks_saved_layout`: it must be what
    :func:`blocks_forward` saves, for every backend and formula."""
    from xopt.kernels import poet_cayley as K

    x = torch.randn(3, 6, device=DEV)  # 3 blocks of 4×4
    for dtype in (torch.float32, torch.bfloat16):
        _, saved = K.blocks_forward(x, 4, formula, False, backend, dtype)
        assert [(tuple(t.shape), t.dtype) for t in saved] == K.blocks_saved_layout(
            3, 4, formula, backend, dtype)


@needs_triton
def test_chain_operators_pass_opcheck():
    """``torch.library.opcheck`` of both operators: the schema, the fake implementations
    against the real ones (shapes, dtypes, strides), the autograd registration and
    AOTAutograd's tracing."""
    from xopt.kernels import poet_cayley as K
    from xopt.torch.poet import POETLinear

    variant = "fast"  # (mem's layout: the compiled-model tests)
    torch.manual_seed(3)
    layer = POETLinear(32, 48, 16, bias=True, bias_requires_grad=True, variant=variant,
                       impl="triton")
    with torch.no_grad():
        layer.oft_R.normal_(0, 0.1)
    x = torch.randn(2, 3, 32, requires_grad=True)
    args = (x, layer.oft_R, layer.bias, layer.weight, layer.perm_in, layer.perm_in_inv,
            layer.perm_out, layer.perm_out_inv, None, None, 0, layer.num_out_blocks,
            variant == "fast", 16, "product", False, torch.float32, K.BACKEND)
    torch.library.opcheck(torch.ops.xopt.poet_chain.default, args)
    out = torch.ops.xopt.poet_chain(*args)
    saved = [t.detach() for t in out[4:]]
    xs = out[1].detach() if variant == "fast" else x.detach()
    y1 = out[3].detach() if variant == "fast" else None
    bargs = (torch.randn(2, 3, 48), xs, y1, out[2].detach(), layer.weight, layer.bias.detach(),
             layer.perm_in, layer.perm_in_inv, layer.perm_out_inv, None, None, 0,
             layer.num_out_blocks, True, True, True, 16, "product", False, K.BACKEND,
             torch.float32, *saved)
    torch.library.opcheck(torch.ops.xopt.poet_chain_backward.default, bargs)
    # the chain given blocks (batch_rotations under compile), and the blocks' operator
    blocks = torch.randn(5, 16, 16, requires_grad=True)
    torch.library.opcheck(torch.ops.xopt.poet_chain.default, (x, blocks, *args[2:]))
    tri = torch.randn(5, 120, requires_grad=True)
    torch.library.opcheck(torch.ops.xopt.poet_blocks.default,
                          (tri, 16, "product", False, torch.float32, K.BACKEND))


@pytest.mark.cuda
@needs_triton
@pytest.mark.skipif(DEV != "cuda", reason="needs a GPU (run on the device)")
@pytest.mark.parametrize(("variant", "mode", "batched"), [
    ("fast", "default", False), ("mem", "default", True), ("fast", "reduce-overhead", True)])
def test_compiled_model_on_the_gpu_is_one_graph_with_the_eager_bits(variant, mode, batched):
    """On a GPU in bfloat16 (the compiled kernels, inductor; ``reduce-overhead``: replayed
    from inductor's CUDA graphs; ``batched``: with :func:`batch_rotations`, as the
    benchmark): the compiled model's outputs and gradients are the eager model's, bit for
    bit, in one graph without recompiling."""
    from xopt.torch.poet import batch_rotations

    widths = (256, 512, 256, 512)
    x = torch.randn(4, 64, 256, device=DEV, dtype=torch.bfloat16)
    g = torch.randn(4, 64, 512, device=DEV, dtype=torch.bfloat16)
    eager, model = (_model(widths, "auto", variant, DEV, torch.bfloat16) for _ in range(2))
    if batched:
        batch_rotations(eager)
        batch_rotations(model)
    want = _run(eager, x, g, steps=1)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, mode=mode)
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = _run(compiled, x, g, steps=3)
    _same(got, want)
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 1
