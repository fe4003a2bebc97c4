"""small_fc_lopt's folded fused kernel compiled for sm_90a on a machine without a GPU.

    python bench/sm90_compile.py [--maxnreg N] [--warps W] [--sa SA] [--prec P] [--nhid N]
                                 [--no-fp-fusion] [--out DIR]

Compiles :func:`xopt.kernels.small_fc_lopt.sfc_fold_fused_kernel` with the module's
settings (PyLO's MLP: hidden width 32, one hidden layer, exact mode; ``--prec tf32`` is
fast mode, ``--nhid 0`` drops the hidden layer, to see what each part costs) through
``triton.compile`` for ``GPUTarget("cuda", 90, 32)``, assembles the PTX with Triton's
bundled ``ptxas`` (``-arch=sm_90a -v``: registers, spills) and disassembles it with
``cuobjdump -sass``; prints the registers, the spill bytes and the instructions of the
kernel's main loop (the longest backward branch) by opcode. ``DISABLE_MMA_V3=1`` in the
environment makes Triton use ``mma.sync`` instead of ``wgmma``. The device's Triton may
compile differently from the local one (bench/RESULTS.md says which was used).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from xopt.kernels import FP_FUSION  # noqa: E402
from xopt.kernels import lopt_layout as L  # noqa: E402
from xopt.kernels import small_fc_lopt as K  # noqa: E402

POINTERS = dict(meta="*i64", pids="*i32", prog="*i32", ptrs="*i64", rcm="*fp32",
                decays="*fp32", norm="*fp32", scal="*fp32", w16n="*fp32", terms="*fp32",
                tofs="*i64", b0="*fp32", wh="*fp32", bh="*fp32", wl="*fp32", bl="*fp32",
                part="*fp64", exp_mult="fp32", step_mult="fp32")


def compile_fused(warps: int, sa: int, maxnreg: int, prec: str = "tf32x3", nhid: int = 1,
                  fp_fusion: bool = True):
    fn = K.sfc_fold_fused_kernel
    cons = dict(PREC=prec, TERMS=K.TERMS, HP=32, NHID=nhid, NPTR=K.NPTR, NF=L.NFIELDS,
                TA=L.TA, TB=L.TB, SA=sa, PREFETCH=K.PREFETCH, AB_ACC=K.AB_ACC,
                LO_RN=K.SPLIT_LO != "hw", RA=K.RA)
    cons = {k: v for k, v in cons.items() if k in fn.arg_names}
    sig = {**POINTERS, **{k: "constexpr" for k in cons}}
    opts = dict(num_warps=warps, num_stages=K.STAGES_FOLD,
                **(FP_FUSION if fp_fusion else {"enable_fp_fusion": False}))
    if maxnreg:
        opts["maxnreg"] = maxnreg
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cons),
                          target=GPUTarget("cuda", 90, 32), options=opts)


def loop_opcodes(sass: str) -> collections.Counter:
    """Opcodes of the instructions between the longest backward branch and its target."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in
           re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]
    loops = []
    for addr, text in ins:
        m = re.search(r"BRA\s+(?:`\()?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            loops.append((addr - int(m.group(1), 16), int(m.group(1), 16), addr))
    if not loops:
        return collections.Counter()
    _, start, end = max(loops)
    return collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0]
                               for a, t in ins if start <= a <= end)


def assemble(ptx: str, out: Path, stem: str) -> tuple[str, str, str]:
    """``ptx`` assembled for sm_90a with Triton's bundled ``ptxas -v`` (into
    ``out/stem.cubin``) and disassembled: ``(registers, spill store bytes, SASS)``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.ptx").write_text(ptx)
    nv = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    ptxas = next(p for p in (nv / "ptxas-blackwell", nv / "ptxas") if p.exists())
    res = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(out / f"{stem}.ptx"), "-o",
                          str(out / f"{stem}.cubin")], capture_output=True, text=True)
    if res.returncode:
        sys.exit(res.stderr)
    regs = re.findall(r"Used (\d+) registers", res.stderr)
    spills = re.findall(r"(\d+) bytes spill stores", res.stderr)
    sass = subprocess.run([str(nv / "cuobjdump"), "-sass", str(out / f"{stem}.cubin")],
                          capture_output=True, text=True).stdout
    return regs[0] if regs else "?", spills[0] if spills else "0", sass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--warps", type=int, default=K.WARPS_FOLD)
    ap.add_argument("--sa", type=int, default=K.SA_FOLD)
    ap.add_argument("--maxnreg", type=int, default=0)
    ap.add_argument("--prec", default="tf32x3", choices=("tf32x3", "tf32"))
    ap.add_argument("--nhid", type=int, default=1)
    ap.add_argument("--no-fp-fusion", action="store_true",
                    help="compile without FMA contraction (xopt.kernels.FP_FUSION off)")
    ap.add_argument("--out", default="/tmp/xopt_sm90")
    a = ap.parse_args()
    kern = compile_fused(a.warps, a.sa, a.maxnreg, a.prec, a.nhid, not a.no_fp_fusion)
    regs, spills, sass = assemble(kern.asm["ptx"], Path(a.out), "fused")
    ops = loop_opcodes(sass)
    print(f"triton {triton.__version__}, {a.prec}, hidden layers {a.nhid}, warps {a.warps}, "
          f"SA {a.sa}, maxnreg "
          f"{a.maxnreg or '-'}, DISABLE_MMA_V3={os.environ.get('DISABLE_MMA_V3', '')}: "
          f"registers {regs}, spill stores {spills} B, loop instructions {sum(ops.values())}")
    print("  " + ", ".join(f"{k} {v}" for k, v in ops.most_common(16)))


if __name__ == "__main__":
    main()
