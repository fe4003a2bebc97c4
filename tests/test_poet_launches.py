"""The launch budget of POETLinear's forward+backward on the triton path.

An eager forward+backward of the layer is paced by the host's launches (bench/poet_layer.py
shows it: eager back to back far slower than its CUDA-graph replay), so the number of
device kernels it launches is bounded here, counted on the host by
:func:`xopt.kernels.poet_launches.count_launches` (ATen kernels and Triton launches; under
``TRITON_INTERPRET=1`` on the CPU, compiled on a GPU). The budget follows from the design:

* forward (7): the Cayley–Neumann blocks of all of the layer's rotations (2: the fused
  backend's factor kernel and one batched product ``Y = A·B``), the input's gather, the
  input rotation (one batched product), ``x2·W0ᵀ`` (one matmul), the output rotation, the
  output's gather;
* backward (9): the cotangent's gather, ``R_out``'s outer products (one batched product),
  the rotation back, ``·W0``, ``R_in``'s outer products, the rotation back, the input
  gradient's gather, and the CNP backward (2 kernels);
* ``variant="mem"``: + 3 in the backward (re-gather, rotation, matmul);
* a bias: + 1 (its addition; mem: + 1 more in the recomputation) and + 1 for its
  gradient (a column sum) when it is trained.
"""

from __future__ import annotations

import pytest
from helpers import has_torch, needs_triton

if has_torch:
    import torch
DEV = "cuda" if has_torch and torch.cuda.is_available() else "cpu"

FWD, BWD, MEM = 7, 9, 3


def _budget(variant: str, bias: bool) -> int:
    n = FWD + BWD + (MEM if variant == "mem" else 0)
    if bias:
        n += (2 if variant == "mem" else 1) + 1
    return n


def _count(layer, x, g):
    from xopt.kernels.poet_launches import count_launches

    params = [p for p in layer.parameters() if p.requires_grad]

    def once():
        x.grad = None
        for p in params:
            p.grad = None
        layer(x).backward(g)

    once()  # (first calls compile or fill caches)
    return count_launches(once)


def _layer(variant, bias, shape=(32, 64)):
    from xopt.torch.poet import POETLinear

    torch.manual_seed(0)
    layer = POETLinear(64, 48, 16, bias=bias, bias_requires_grad=bias, variant=variant,
                       impl="triton").to(DEV)
    with torch.no_grad():
        layer.oft_R.normal_(0, 0.05)
    x = torch.randn(*shape, device=DEV, requires_grad=True)
    g = torch.randn(*shape[:-1], 48, device=DEV)
    return layer, x, g


@needs_triton
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("variant", ["fast", "mem"])
def test_forward_backward_stays_within_its_launch_budget(variant, bias, monkeypatch):
    from xopt.kernels import poet_cayley as K

    monkeypatch.setattr(K, "BACKEND", "fused")
    c = _count(*_layer(variant, bias))
    assert c.launches <= _budget(variant, bias), str(c)
    # the kernels are the ones of the design: the products in cuBLAS, the rest in Triton
    assert set(c.aten) <= {"bmm", "mm", "add_", "sum"}, str(c)
    assert c.triton["_perm_smem_kernel"] + c.triton["_perm_rowloop_kernel"] == (
        5 if variant == "mem" else 4), str(c)
    assert sum(c.triton.values()) - 4 - (variant == "mem") == 3, str(c)


@needs_triton
def test_launch_count_sees_every_launch(monkeypatch):
    """The counter is not blind: a 3-d input costs no launch (views only), and the
    batched-matmul CNP backend, whose launches are known (skew, B = I + Q² in place,
    A = B + 2Q, Y = AB; backward GB, AᵀG, the symmetrization, ZQ, the triangles: 9
    against the fused backend's 4), counts 5 more."""
    from xopt.kernels import poet_cayley as K

    monkeypatch.setattr(K, "BACKEND", "fused")
    base = _count(*_layer("fast", False)).launches
    assert base == _budget("fast", False)
    assert _count(*_layer("fast", False, shape=(2, 16, 64))).launches == base
    monkeypatch.setattr(K, "BACKEND", "bmm")
    assert _count(*_layer("fast", False)).launches == base + 5


#: host-only ATen calls (views, allocations) of a 2-d forward+backward on the default
#: (batched-matmul) CNP backend, from the design. Forward: the CNP's skew blocks and
#: identities (2 allocations), each gather's output (1), each rotation's blocks view,
#: input-rows view, output and its 2-d view (4), ``W0ᵀ`` (1): 2 + 1 + 4 + 1 + 4 + 1 = 13.
#: Backward: the gathers (1 each), ``grad_r`` and its two halves (3), each outer product's
#: two row views (2), the rotations back (4 each), the CNP backward's ``Aᵀ`` view,
#: symmetrised buffer and triangles' gradient (3), and autograd's two ``detach`` of the
#: leaves' gradients: 1 + 3 + 2 + 4 + 2 + 4 + 1 + 3 + 2 = 22. ``mem`` adds the backward's
#: re-gather (1), rotation (4) and ``W0ᵀ`` (1).
HOST_ONLY = {"fast": 13 + 22, "mem": 13 + 22 + 6}


@needs_triton
@pytest.mark.parametrize("variant", ["fast", "mem"])
def test_forward_backward_host_calls_stay_within_the_design(variant, monkeypatch):
    """The host's share of an eager forward+backward, counted: on the default CNP backend
    the design's launches (21 fast, 24 mem: the fused backend's budget plus the bmm
    backend's 5) and no more host-only ATen calls than the design needs (HOST_ONLY), the
    rotations' blocks taken as views of the stacked blocks (no slices, no transposes)."""
    from xopt.kernels import poet_cayley as K

    monkeypatch.setattr(K, "BACKEND", "bmm")
    c = _count(*_layer(variant, False))
    assert c.launches == _budget(variant, False) + 5, str(c)
    assert sum(c.host.values()) <= HOST_ONLY[variant], str(c)
    assert c.host["slice"] == 2 and c.host["transpose"] == 1, str(c)  # grad_r's halves, Aᵀ


def _stack(seed=0):
    from xopt.torch.poet import POETLinear

    torch.manual_seed(seed)
    widths = [32, 48, 32, 32, 48]
    layers = []
    for i in range(4):
        layer = POETLinear(widths[i], widths[i + 1], 16, impl="triton").to(DEV)
        with torch.no_grad():
            layer.oft_R.normal_(0, 0.05)
        layers += [layer, torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def _close(u, v):
    # the same per-block arithmetic over a longer batch of blocks (cuBLAS/MKL may block a
    # batched product differently by batch count: not claimed bit for bit)
    return (u - v).abs().max() <= 1e-6 * v.abs().max()


@needs_triton
def test_batched_rotations_match_per_layer_and_save_launches(monkeypatch):
    """:func:`batch_rotations`: one CNP evaluation for the 4 layers (3 launches each way:
    the stacking, the factor kernel and the product; backward the stacking, two kernels)
    instead of 2 per layer each way, with the same outputs and gradients; an optimizer
    step makes the stashed blocks stale (the layer called alone then evaluates its own),
    and a no_grad forward and a checkpointed one work."""
    from torch.utils.checkpoint import checkpoint

    from xopt.kernels import poet_cayley as K
    from xopt.kernels.poet_launches import count_launches
    from xopt.torch.poet import POETLinear, batch_rotations

    monkeypatch.setattr(K, "BACKEND", "fused")
    ref, model = _stack(), _stack()
    handle = batch_rotations(model)
    x = torch.randn(6, 32, device=DEV)
    g = torch.randn(6, 48, device=DEV)

    def run(m, fn=None):
        for p in m.parameters():
            p.grad = None
        xx = x.clone().requires_grad_()
        y = (fn or m)(xx)
        y.backward(g)
        return [y, xx.grad] + [p.grad for p in m.parameters() if p.requires_grad]

    for u, v in zip(run(model), run(ref), strict=True):
        assert _close(u, v)
    n_ref, n = count_launches(run, ref).launches, count_launches(run, model).launches
    assert n == n_ref - 4 * 4 + 6, (n, n_ref)
    # checkpointed: the recomputation takes the same stashed blocks
    for u, v in zip(run(model, lambda t: checkpoint(model, t, use_reentrant=False)), run(ref),
                    strict=True):
        assert _close(u, v)
    with torch.no_grad():
        assert _close(model(x), ref(x))
    # a step changes oft_R in place: the stash is stale for a layer called on its own
    model(x)
    first, first_ref = model[0], ref[0]
    with torch.no_grad():
        for layer in (first, first_ref):
            layer.oft_R.add_(0.01)
    assert isinstance(first, POETLinear)
    assert _close(first(x), first_ref(x))
    handle.remove()
    assert _close(model(x), ref(x))


@needs_triton
@pytest.mark.skipif(DEV != "cuda", reason="CUDA graphs need a GPU (run on the device)")
def test_batched_rotations_are_cuda_graph_capturable():
    """The hook and the batched evaluation do no host↔device copies and no syncs: a model's
    forward+backward with :func:`batch_rotations` captured in a CUDA graph and replayed
    gives the eager results, bit for bit."""
    from xopt.torch.poet import batch_rotations

    model = _stack().to(torch.bfloat16)
    batch_rotations(model)
    x = torch.randn(8, 32, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(8, 48, device=DEV, dtype=torch.bfloat16)
    params = [p for p in model.parameters() if p.requires_grad]

    def reset():
        x.grad = None
        for p in params:
            p.grad = None

    y = model(x)
    y.backward(g)
    eager = [y.detach().clone(), x.grad.clone(), *(p.grad.clone() for p in params)]
    del y
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            reset()
            model(x).backward(g)
    torch.cuda.current_stream().wait_stream(side)
    reset()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static = model(x)
        y_static.backward(g)
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip([y_static, x.grad, *(p.grad for p in params)], eager, strict=True):
        assert torch.equal(got, want)


# -- the direct launch (xopt.kernels.poet_jit) ------------------------------------------------


class _Compiled:
    """A compiled kernel's face as JITFunction.run uses it: ``run``, ``function``,
    ``packed_metadata``; records the launches made through it."""

    function, packed_metadata = "function", "packed"

    def __init__(self):
        self.launches = []

    def run(self, *args):
        self.launches.append(args)


class JITFunction:
    """A stand-in for Triton's class (poet_jit launches only JITFunctions directly):
    ``kernel[grid](...)`` records the ordinary launch and returns the compiled kernel."""

    __name__ = "stand_in_kernel"
    arg_names = ["x_ptr", "out_ptr", "N", "alpha", "FLAG", "BLOCK"]
    pre_run_hooks: list = []

    def __init__(self):
        self.compiled, self.ordinary = _Compiled(), []

    def __getitem__(self, grid):
        def call(*args, **meta):
            self.ordinary.append((grid, args, meta))
            return self.compiled
        return call


@pytest.fixture
def direct(monkeypatch):
    """poet_jit with a stand-in driver and knobs, the convention accepted, compiled mode."""
    import types

    from xopt.kernels import poet_jit

    runtime = types.SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None)
    active = types.SimpleNamespace(get_current_device=lambda: 0,
                                   get_current_stream=lambda device: 1234)
    monkeypatch.setattr(poet_jit, "_state", {"ok": True, "knobs": types.SimpleNamespace(
        runtime=runtime), "driver": types.SimpleNamespace(active=active)})
    monkeypatch.setattr(poet_jit, "_CACHES", {})
    monkeypatch.setattr(poet_jit, "ENABLED", True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return poet_jit, runtime


@pytest.mark.skipif(not has_torch, reason="needs torch")
def test_direct_launch_replays_the_ordinary_launch_of_the_same_specialisation(direct):
    """The first call of a specialisation is the ordinary ``kernel[grid](...)`` (it compiles);
    later calls with the same key go to the compiled kernel's launcher with what
    JITFunction.run passes it (grid, stream, function, metadata, no launch metadata, the
    hooks, every parameter in signature order: the constexprs after the arguments). What
    Triton specialises on (dtype, 16-byte alignment, each int's value) or another
    constexpr or option makes a new key: an ordinary launch again."""
    poet_jit, runtime = direct
    k = JITFunction()
    x = torch.zeros(64)
    out = torch.zeros(64)
    meta = dict(FLAG=True, BLOCK=16, num_warps=4)
    poet_jit.launch(k, (3,), x, out, 64, 0.5, **meta)
    assert len(k.ordinary) == 1 and k.compiled.launches == []
    poet_jit.launch(k, (5, 2), x, out, 64, 0.25, **meta)  # (grid and float values: same key)
    assert len(k.ordinary) == 1
    assert k.compiled.launches == [(5, 2, 1, 1234, "function", "packed", None, None, None,
                                    x, out, 64, 0.25, True, 16)]
    for args, kw in [((x, out, 65, 0.5), meta),  # another int value
                     ((x.double(), out, 64, 0.5), meta),  # another dtype
                     ((x[1:], out, 64, 0.5), meta),  # misaligned
                     ((x, out, 64, 0.5), {**meta, "BLOCK": 32}),  # another constexpr
                     ((x, out, 64, 0.5), {**meta, "num_warps": 8})]:  # another option
        n = len(k.ordinary)
        poet_jit.launch(k, (1,), *args, **kw)
        assert len(k.ordinary) == n + 1
    # an argument of another kind, a launch hook (a profiler) or the switch off: ordinary
    n, m = len(k.ordinary), len(k.compiled.launches)
    poet_jit.launch(k, (1,), x, out, None, 0.5, **meta)
    runtime.launch_enter_hook = print
    poet_jit.launch(k, (1,), x, out, 64, 0.5, **meta)
    runtime.launch_enter_hook = None
    poet_jit.ENABLED = False
    poet_jit.launch(k, (1,), x, out, 64, 0.5, **meta)
    assert len(k.ordinary) == n + 3 and len(k.compiled.launches) == m
    poet_jit.ENABLED = True
    poet_jit.launch(k, (1,), x, out, 64, 0.5, **meta)
    assert len(k.compiled.launches) == m + 1


@pytest.mark.skipif(not has_torch, reason="needs torch")
def test_direct_launch_is_counted_and_off_under_the_interpreter(direct, monkeypatch):
    """count_launches sees the direct launches; under TRITON_INTERPRET=1 (no compiled
    kernel) and while torch.compile traces (it takes ``kernel[grid](...)`` as a
    user-defined Triton kernel) every launch is the ordinary one."""
    from xopt.kernels.poet_launches import count_launches

    poet_jit, _ = direct
    k = JITFunction()
    x = torch.zeros(64)
    for _ in range(2):
        poet_jit.launch(k, (1,), x, x, 64, 0.5, FLAG=False, BLOCK=16)
    c = count_launches(poet_jit.launch, k, (1,), x, x, 64, 0.5, FLAG=False, BLOCK=16)
    assert c.triton == {"stand_in_kernel": 1} and c.direct == 1 and len(k.compiled.launches) == 2
    with monkeypatch.context() as m:  # while torch.compile traces
        m.setattr(torch.compiler, "is_compiling", lambda: True)
        poet_jit.launch(k, (1,), x, x, 64, 0.5, FLAG=False, BLOCK=16)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    poet_jit.launch(k, (1,), x, x, 64, 0.5, FLAG=False, BLOCK=16)
    assert len(k.ordinary) == 3 and len(k.compiled.launches) == 2


@needs_triton
def test_direct_launch_recognises_the_launch_convention():
    """:func:`poet_jit.matches` accepts the call JITFunction.run makes (3.9; 3.4-era)
    and refuses older conventions (non-constexpr arguments only; ``kernel.metadata``); the
    installed Triton's run is read where it is 3.9 (the release read here)."""
    import triton

    from xopt.kernels import poet_jit

    known = """
            launch_metadata = kernel.launch_metadata(grid, stream, *bound_args.values())
            kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata,
                       launch_metadata, knobs.runtime.launch_enter_hook,
                       knobs.runtime.launch_exit_hook, *bound_args.values())"""
    assert poet_jit.matches(known)
    older = known.replace("*bound_args.values())", "*non_constexpr_vals)")
    assert not poet_jit.matches(older)
    assert not poet_jit.matches(known.replace("kernel.packed_metadata", "kernel.metadata"))
    version = tuple(int(v) for v in triton.__version__.split(".")[:2])
    if version == (3, 9):
        import inspect

        from triton.runtime import jit

        assert poet_jit.matches(inspect.getsource(jit.JITFunction.run))


@needs_triton
@pytest.mark.skipif(DEV != "cuda", reason="compiled kernels need a GPU (run on the device)")
def test_direct_launches_engage_and_change_nothing_on_a_gpu(monkeypatch):
    """On a GPU every Triton launch of a warm forward+backward goes through the compiled
    kernel's launcher (where the installed Triton's convention is the known one), with the
    ordinary launches' results, bit for bit."""
    from xopt.kernels import poet_cayley as K
    from xopt.kernels import poet_jit

    monkeypatch.setattr(K, "BACKEND", "bmm")
    layer, x, g = _layer("fast", False)
    results = []
    for enabled in (False, True):
        monkeypatch.setattr(poet_jit, "ENABLED", enabled)
        c = _count(layer, x, g)
        results.append([x.grad.clone(), layer.oft_R.grad.clone()])
        if enabled and poet_jit._convention_ok():
            assert c.direct == sum(c.triton.values()) == 7, str(c)
    for u, v in zip(*results, strict=True):
        assert torch.equal(u, v)
