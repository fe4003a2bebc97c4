"""xopt.kernels.normal: xopt.random's portable normal in one Triton launch, bit for bit the
torch backend's draw (under TRITON_INTERPRET=1 on a CPU, compiled on a GPU), and Flora's
compressed momentum drawing its projections with it along the same trajectory.

The interpreter evaluates the kernel's operations with NumPy, one IEEE operation each; what
a GPU compile could change (contraction into FMA, approximate division or roots) is checked
in the sm_90 machine code, compiled here without a GPU."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
from helpers import REPO, has_torch, triton_kernel_target

pytestmark = pytest.mark.skipif(not has_torch, reason="needs torch")

if has_torch:
    import torch

needs_kernel, DEVICE = triton_kernel_target()

SEEDS = [0, 2**63 + 5, 2**64 - 1]
_VIEW = {"float32": "int32", "float64": "int64"}


def _bits(x, dtype):
    return x.view(getattr(torch, _VIEW[dtype])).cpu()


def _cases(dtype):
    """(seeds, shape, counter): one value; a counter whose low word carries into the high
    word inside the draw; an odd size ending inside a program's third tile with the high
    word already set; an empty draw; the stream's last blocks."""
    import xopt.random as R
    from xopt.kernels import normal

    last = (7,)
    return [(SEEDS, (), 0), (SEEDS, (3, 5), 2**32 - 3),
            (SEEDS[1:2], (2 * 2 * normal._PAIRS + 3,), (5 << 32) + 2**32 - 300),
            (SEEDS, (2, 0), 9), (SEEDS[::2], last, 2**64 - R.blocks_used(last, dtype))]


def _check_draws(dtype, cases):
    import xopt.random as R
    from xopt.kernels import normal

    for seeds, shape, counter in cases:
        got = normal.normal_many(seeds, shape, counter=counter, dtype=dtype, device=DEVICE)
        ref = R.normal_many(seeds, shape, counter=counter, dtype=dtype, backend="torch",
                            device=DEVICE)
        assert got.shape == ref.shape == (len(seeds), *shape)
        assert got.dtype == ref.dtype == getattr(torch, dtype) and got.device == ref.device
        assert torch.equal(_bits(got, dtype), _bits(ref, dtype)), (shape, counter)


@needs_kernel
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_draws_are_the_torch_backends_bits(dtype):
    _check_draws(dtype, _cases(dtype))


@needs_kernel
def test_rows_over_launches_and_wide_offsets(monkeypatch):
    """Seeds beyond a launch's rows go to the next launch, from their own row; the 64-bit
    offsets of rows of 2**31 numbers or more (here forced on a small draw) give the same
    bits."""
    from xopt.kernels import normal

    launches = _Launches(normal._normal_kernel)
    monkeypatch.setattr(normal, "_normal_kernel", launches)
    monkeypatch.setattr(normal, "_GRID_Y", 2)
    monkeypatch.setattr(normal, "_WIDE_FROM", 0)
    seeds = [2**64 - 1 - 7 * i for i in range(5)]
    _check_draws("float32", [(seeds, (3, 2 * normal._PAIRS + 1), 2**32 - 100)])
    assert launches.count == 3


def test_reference_division_and_root_are_ieee():
    """The premise of the kernel's div_rn and sqrt_rn: xopt.random's integer long division
    and digit-by-digit root are IEEE's correctly rounded results (NumPy's, one IEEE
    operation each) on the draws' own operands, ``f / (f + 2)`` in log and the root of
    ``|-2 log u1|``, over a strided sample of every ``u1`` a draw can give (and its ends)."""
    import numpy as np

    import xopt.random as R

    for dtype, bits in (("float32", 24), ("float64", 53)):
        fmt, ops = R._FORMATS[dtype], R._NumpyOps
        ftype = fmt.np_dtype.type
        j = np.concatenate([np.arange(0, 2**bits, 2**bits // 2**14 + 1, dtype=np.uint64),
                            np.arange(2**10, dtype=np.uint64),
                            2**bits - 1 - np.arange(2**10, dtype=np.uint64)])
        u1 = ftype(1.0) - j.astype(fmt.np_dtype) * ftype(2.0**-bits)  # exact
        i = u1.view(fmt.np_uint)
        m = ((i & fmt.mant_mask) | fmt.one_bits).view(fmt.np_dtype)  # log's own steps
        f = np.where(m > ftype(fmt.sqrt2), m * ftype(0.5), m) - ftype(1.0)
        quotient = R._div(ops, f, f + ftype(2.0), fmt)
        assert np.array_equal(quotient.view(fmt.np_uint), (f / (f + ftype(2.0))).view(fmt.np_uint))
        x = np.abs(R._log(ops, u1, fmt) * ftype(-2.0))
        assert np.array_equal(R._sqrt(ops, x, fmt).view(fmt.np_uint), np.sqrt(x).view(fmt.np_uint))
        tiny = np.finfo(fmt.np_dtype).tiny  # normal operands and results: no subnormal to flush
        for v in (f, quotient, x):
            assert np.all((v == 0) | (np.abs(v) >= tiny))


@needs_kernel
def test_dtype_spellings():
    """dtypes as torch and numpy spell them, as xopt.random accepts them."""
    import numpy as np

    import xopt.random as R
    from xopt.kernels import normal

    ref = R.normal_many([9], (5,), counter=3, backend="torch", device=DEVICE)
    for dtype in (torch.float32, np.float32):
        got = normal.normal_many([9], (5,), counter=3, dtype=dtype, device=DEVICE)
        assert torch.equal(_bits(got, "float32"), _bits(ref, "float32"))


@needs_kernel
def test_bad_arguments_are_named_and_launch_nothing(monkeypatch):
    """The reference's checks and messages, before any launch."""
    from xopt.kernels import normal

    monkeypatch.setattr(normal, "_normal_kernel", None)  # a launch would fail differently
    bad = [(dict(seeds=[1, -2]), r"seeds\[1\]"), (dict(seeds=[]), "seeds is empty"),
           (dict(seeds=3), "seeds must be a sequence"), (dict(shape=(2, -1)), "shape"),
           (dict(dtype="bfloat16"), "dtype"), (dict(counter=-1), "counter"),
           (dict(counter=2**64 - 1), "runs past 2\\*\\*64"),
           (dict(shape=(2**33 + 1,)), "too large for one draw")]
    for change, match in bad:
        kw = dict(seeds=[1, 2], shape=(3,), counter=0, dtype="float32") | change
        with pytest.raises(ValueError, match=match):
            normal.normal_many(kw.pop("seeds"), kw.pop("shape"), device=DEVICE, **kw)


if has_torch and importlib.util.find_spec("triton") is not None:
    import triton
    import triton.language as tl

    from xopt.kernels.normal import _cos_sin_turns, _log, _sqrt_rn

    @triton.jit
    def _steps(u1_ptr, u2_ptr, out_ptr, n, F64: tl.constexpr, MB: tl.constexpr,
               BIAS: tl.constexpr, SQRT2: tl.constexpr, LN2_HI: tl.constexpr,
               LN2_LO: tl.constexpr, LOG_C: tl.constexpr, SIN_HI: tl.constexpr,
               SIN_LO: tl.constexpr, SIN_C: tl.constexpr, COS_C: tl.constexpr,
               BLOCK: tl.constexpr):
        """The kernel's log, root and turn functions on given ``u1``, ``u2``."""
        FT: tl.constexpr = tl.float64 if F64 else tl.float32
        UT: tl.constexpr = tl.uint64 if F64 else tl.uint32
        i = tl.arange(0, BLOCK)
        mask = i < n
        u1 = tl.load(u1_ptr + i, mask=mask, other=1.0)
        u2 = tl.load(u2_ptr + i, mask=mask, other=0.0)
        lg = _log(u1, FT, UT, MB, BIAS, SQRT2, LN2_HI, LN2_LO, LOG_C)
        r = _sqrt_rn(tl.abs(lg * -2.0))
        cos, sin = _cos_sin_turns(u2, SIN_HI, SIN_LO, SIN_C, COS_C)
        tl.store(out_ptr + i, lg, mask=mask)
        tl.store(out_ptr + n + i, r, mask=mask)
        tl.store(out_ptr + 2 * n + i, cos, mask=mask)
        tl.store(out_ptr + 3 * n + i, sin, mask=mask)


def _edge_inputs(dtype):
    """``(u1, u2)``: the Box-Muller inputs at the steps' edges: u1 = 1 (log 0) and the
    smallest u1; significands on both sides of sqrt 2 (log's halving), exactly at the
    format's sqrt 2 and, in float64, around float32's sqrt 2; u2 at quadrant boundaries
    and on both sides of the octant switch (f = 1/2)."""
    import numpy as np

    f = np.dtype(dtype).type
    eps = f(2.0 ** (-24 if dtype == "float32" else -53))
    s2 = f(np.sqrt(2.0, dtype=f))
    s2_32 = f(np.float32(np.sqrt(np.float32(2.0))))
    around = [np.nextafter(x, t, dtype=f) for x in (s2, s2_32) for t in (f(0), f(2))]
    u1 = [f(1.0), eps, f(0.5), s2 / 2, s2_32 / 2, *(a / 2 for a in around), f(0.75), f(0.3)]
    u2 = [f(0.0), f(0.125), f(0.125) - eps, f(0.125) + eps, f(0.25), f(0.5), f(0.75),
          f(1.0) - eps, f(0.375), f(0.625) + eps, f(0.9)]
    n = max(len(u1), len(u2))
    u1, u2 = (u1 * n)[:n], (u2 * n)[:n]
    return torch.tensor(np.array(u1, dtype=f)), torch.tensor(np.array(u2, dtype=f))


@needs_kernel
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_steps_at_edge_inputs_are_the_references(dtype):
    """The kernel's log, square root and turn functions on chosen inputs (not left to the
    draw's chance) against xopt.random's own steps on the same values."""
    import xopt.random as R
    from xopt.kernels import NO_FP_FUSION, normal

    u1, u2 = _edge_inputs(dtype)
    n = len(u1)
    out = torch.empty((4, n), dtype=u1.dtype, device=DEVICE)
    _steps[(1,)](u1.to(DEVICE), u2.to(DEVICE), out, n, BLOCK=32, **normal._constants(dtype),
                **NO_FP_FUSION)
    ops, fmt = R._TorchOps("cpu"), R._FORMATS[dtype]
    lg = R._log(ops, u1, fmt)
    cos, sin = R._cos_sin_turns(ops, u2, fmt)
    ref = torch.stack([lg, R._sqrt(ops, (lg * -2.0).abs(), fmt), cos, sin])
    for k, name in enumerate(("log", "sqrt", "cos", "sin")):
        assert torch.equal(_bits(out[k], dtype), _bits(ref[k], dtype)), name


def test_backend_knob(monkeypatch):
    pytest.importorskip("triton")
    from xopt.kernels import normal

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for backend, want in (("auto", (False, True)), ("torch", (False, False)),
                          ("triton", (True, True))):
        monkeypatch.setattr(normal, "BACKEND", backend)
        assert (normal.runs_on(cpu), normal.runs_on(cuda)) == want
    monkeypatch.setattr(normal, "BACKEND", "cuda")
    with pytest.raises(ValueError, match="XOPT_NORMAL"):
        normal.runs_on(cpu)


class _Launches:
    """The kernel, counting its launches."""

    def __init__(self, kernel):
        self.kernel, self.count = kernel, 0

    def __getitem__(self, grid):
        self.count += 1
        return self.kernel[grid]


def _flora(backend, monkeypatch, dtype):
    """Flora with compressed momentum over three steps: two same-shaped matrices (one
    stack), a right-compressed matrix with weight decay (the per-parameter step) and a
    vector; a transfer at step 2. Returns the parameters, the optimizer and the kernel's
    launches per step."""
    import xopt.random as R
    import xopt.torch as xt
    from xopt.kernels import normal

    monkeypatch.setattr(normal, "BACKEND", backend)
    counter = _Launches(normal._normal_kernel)
    monkeypatch.setattr(normal, "_normal_kernel", counter)
    if backend == "triton":  # every draw is the kernel's
        for name in ("normal", "normal_many"):
            monkeypatch.setattr(R, name, None)
    gen = torch.Generator().manual_seed(5)
    shapes = [(4, 6), (4, 6), (7, 5), (3,)]
    ps = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype).to(DEVICE))
          for s in shapes]
    opt = xt.Flora([{"params": ps[:2] + ps[3:]}, {"params": ps[2:3], "weight_decay": 0.1}],
                   lr=1e-2, beta1=0.9, rank=2, kappa=2, seed=2**61 + 3)
    launches = []
    for _ in range(3):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen).to(dtype).to(DEVICE)
        before = counter.count
        opt.step()
        launches.append(counter.count - before)
    return ps, opt, launches


@needs_kernel
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_flora_trajectory_is_the_torch_draws(dtype, monkeypatch):
    """Three steps (the first per parameter, then stacked; a transfer at step 2):
    parameters, momenta, second moments, RMS and seeds bit for bit those of the torch
    draws. One launch per draw: per parameter at the first step, then one for the stack
    (its seeds before and after the transfer together) and one for the weight-decayed
    matrix."""
    dtype = getattr(torch, dtype)
    pa, oa, launches = _flora("triton", monkeypatch, dtype)
    monkeypatch.undo()
    pb, ob, none = _flora("torch", monkeypatch, dtype)
    assert launches == [3, 2, 2] and none == [0, 0, 0]
    for p, q in zip(pa, pb, strict=True):
        sa, sb = oa.state[p], ob.state[q]
        assert list(sa) == list(sb) and sa["step"] == sb["step"] == 3
        assert sa["seed"] == sb["seed"]
        for k, v in sa.items():
            if isinstance(v, torch.Tensor):
                assert v.dtype == sb[k].dtype and torch.equal(v, sb[k]), k
        assert torch.equal(p.detach(), q.detach())
    # the compressed matrices' seeds moved at the transfer; the right one's momentum is (m, r)
    assert all(oa.state[p]["seed"] != oa._initial_seed(p) for p in pa[:3])
    assert oa.state[pa[2]]["exp_avg"].shape == (7, 2)


_SASS = r"""
import collections, json, re, struct, subprocess, sys
from pathlib import Path
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from xopt.kernels import NO_FP_FUSION, normal


@triton.jit
def rn_only(x_ptr, out_ptr, PAIRS: tl.constexpr):
    # the kernel's correctly rounded division and root alone, laid out as its pairs
    i = tl.arange(0, PAIRS)
    x = tl.load(x_ptr + i)
    tl.store(out_ptr + i, normal._div_rn(x, tl.load(x_ptr + PAIRS + i)))
    tl.store(out_ptr + PAIRS + i, normal._sqrt_rn(x))


nvidia = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
LINE = re.compile(r"^\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z0-9_.]+)", re.M)


def build(fn, sig, consts, name):
    sig = dict(sig, **{k: "constexpr" for k in consts})
    compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": normal._WARPS, **NO_FP_FUSION})
    cubin = Path(sys.argv[1], name + ".cubin")
    cubin.write_bytes(compiled.asm["cubin"])
    sass = subprocess.run([str(nvidia / "cuobjdump"), "-sass", str(cubin)],
                          capture_output=True, text=True, check=True).stdout
    return compiled.asm["ptx"], LINE.findall(sass)


out = {}
for dtype, ptr in (("float32", "*fp32"), ("float64", "*fp64")):
    consts = dict(normal._constants(dtype), PAIRS=normal._PAIRS, WIDE=False)
    ptx, ops = build(normal._normal_kernel,
                     {"words_ptr": "*i64", "out_ptr": ptr, "n": "i32", "row0": "i32"},
                     consts, dtype)
    _, rn_ops = build(rn_only, {"x_ptr": ptr, "out_ptr": ptr}, {"PAIRS": normal._PAIRS},
                      dtype + "_rn")
    fmt, tag = (">f", "0f") if dtype == "float32" else (">d", "0d")
    values = [consts[k] for k in ("SQRT2", "LN2_HI", "LN2_LO", "SIN_HI", "SIN_LO")]
    values += [*consts["LOG_C"], *consts["SIN_C"], *consts["COS_C"]]
    missing = [v for v in values  # each as its exact bits (or its negation's: a - z*c)
               if not any(tag + struct.pack(fmt, w).hex().upper() in ptx for w in (v, -v))]
    out[dtype] = {"sass": sorted(set(ops)), "ptx": ptx, "missing": missing,
                  "counts": collections.Counter(ops), "rn_counts": collections.Counter(rn_ops),
                  "per_thread": normal._PAIRS // (32 * normal._WARPS)}
print(json.dumps(out))
"""

#: machine-code instructions that only ptxas's correctly rounded division and root may hold:
#: their Newton steps are fused multiply-adds from hardware approximations (MUFU), corrected
#: to IEEE's result (PTX guarantees div.rn/sqrt.rn are), and their fast paths flush to zero
_DIV_SQRT_OWN = ("FFMA", "DFMA", "MUFU")


def _own(counts):
    return {op: k for op, k in counts.items()
            if op.split(".")[0] in _DIV_SQRT_OWN or (".FTZ" in op and not op.startswith("FRND"))}


def test_compiled_kernel_has_no_contraction_or_approximation(tmp_path):
    """The kernel compiled for an H100/H200 (sm_90) without a GPU, as a launch compiles it
    (NO_FP_FUSION). Its PTX asks for round-to-nearest products and sums (which ptxas never
    contracts), one ``div.rn`` and one ``sqrt.rn`` per pair (correctly rounded by PTX's
    definition) and no other float division, root, reciprocal, log, trigonometry or fused
    multiply-add, approximate or not, and holds every constant of xopt.random's format
    tables at its exact bits. Its machine code has exactly the fused multiply-adds, MUFU
    approximations and flush-to-zero instructions of those divisions and roots compiled
    alone (so none of the kernel's own products and sums was fused), and the words' shifts
    and comparisons are unsigned."""
    triton = pytest.importorskip("triton")
    from pathlib import Path

    nvidia = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not (nvidia / "ptxas").is_file() or not (nvidia / "cuobjdump").is_file():
        pytest.skip("triton without its NVIDIA tools (ptxas, cuobjdump)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    script = tmp_path / "compile_normal.py"  # a file: triton.jit reads its source
    script.write_text(_SASS)
    run = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True,
                         text=True, env=env, cwd=REPO, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    for dtype, got in json.loads(run.stdout.splitlines()[-1]).items():
        ptx, width = got["ptx"], dtype[-2:]
        assert _own(got["counts"]) == _own(got["rn_counts"]), dtype
        assert _own(got["counts"]), dtype  # (the comparison has something to compare)
        # no half-precision FMA (HFMA2.MMA with zero operands is ptxas's way to move a constant)
        assert not [op for op in got["counts"] if op.startswith("HFMA2") and op != "HFMA2.MMA"]
        # the words' shifts and comparisons unsigned, as the interpreter's uint32 arithmetic:
        # the only signed comparisons are the stores' bounds (int32 offsets), one per store
        assert not re.search(r"\bshr\.s(32|64)\b", ptx), dtype
        signed = re.findall(r"setp\.[a-z]+\.s32\s+(%p\d+),", ptx)
        assert sorted(signed) == sorted(re.findall(r"@(%p\d+)\s+st\.global", ptx)), dtype
        float_ops = [line.split()[0] for line in ptx.splitlines()
                     if line.strip() and (".f32" in line or ".f64" in line)]
        # flush-to-zero (as some Triton versions lower floor, div_rn or sqrt_rn) only where
        # no operand or result is subnormal: floor's 4·u2 (0 or >= 2**-22), the division's
        # and root's (test_reference_division_and_root_are_ieee)
        flushing = {op.split(".")[0] for op in float_ops if ".ftz" in op}
        assert flushing <= {"cvt", "div", "sqrt"}, (dtype, flushing)
        float_ops = [op.replace(".ftz", "") for op in float_ops]
        allowed = ("add.rn.", "sub.rn.", "mul.rn.", "neg.", "abs.", "setp.", "selp.",
                   "mov.", "cvt.rn.f32.", "cvt.rn.f64.", "cvt.rmi.", "ld.", "st.",
                   f"div.rn.f{width}", f"sqrt.rn.f{width}")
        assert all(op.startswith(allowed) for op in float_ops), (dtype, set(float_ops))
        assert any(op.startswith("mul.rn.") for op in float_ops)
        per_pair = got["per_thread"]  # the reference's one division (in log) and one root
        assert float_ops.count(f"div.rn.f{width}") == per_pair, dtype
        assert float_ops.count(f"sqrt.rn.f{width}") == per_pair, dtype
        assert got["missing"] == [], dtype  # constants not rounded through another format


@pytest.mark.cuda
@pytest.mark.skipif(not (has_torch and torch.cuda.is_available()), reason="needs a CUDA GPU")
def test_gpu_draw_at_flora_shapes_is_the_torch_backends():
    """On a GPU, at LLaMA-1B's projection shape (rank 512 of 2048): 2**24 numbers per
    dtype, the compiled kernel against the torch backend on the same GPU, and its first
    row against NumPy's draw."""
    import xopt.random as R
    from xopt.kernels import normal

    seeds = [2**62 + 3 + i for i in range(16)]
    for dtype in ("float32", "float64"):
        got = normal.normal_many(seeds, (512, 2048), counter=2**32 - 5, dtype=dtype,
                                 device="cuda")
        ref = R.normal_many(seeds, (512, 2048), counter=2**32 - 5, dtype=dtype,
                            backend="torch", device="cuda")
        assert torch.equal(_bits(got, dtype), _bits(ref, dtype)), dtype
        first = torch.from_numpy(R.normal(seeds[0], (512, 2048), counter=2**32 - 5,
                                          dtype=dtype))  # NumPy's, the portable reference
        assert torch.equal(_bits(got[0], dtype), _bits(first, dtype)), dtype
