"""Compile mlp_core.py's kernels for sm_90a on the CPU (no GPU needed) and print registers
(the bundled ptxas -v), shared memory and SASS counts; files under /tmp/gsp/<triton version>/.

    python bench/gluon_spike/compile_sm90.py [A B0 B0s B1 B1s B0sh1 B1sh1 B1sh2 ...]
    PRODUCTS=1 python bench/gluon_spike/compile_sm90.py A B0s   # fast mode
"""
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pathlib import Path

import mlp_core as M
import triton
from sm90_compile import assemble
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource

names = "g_ptr p_ptr t_ptr cf_ptr w1_ptr w2_ptr vec_ptr d_ptr m_ptr".split()
def sig():
    s = {n: "*fp32" for n in names}
    s["N"] = os.environ.get("NTYPE", "i32")  # the launch passes N < 2**31: i32
    return s
def build(tag, which, **cons):
    s = sig()
    cons = dict(BLOCK=128, K1=16, HP=32, PRODUCTS=int(os.environ.get("PRODUCTS", 3)), **cons)
    for c in cons:
        s[c] = "constexpr"
    if which == "A":
        src = ASTSource(fn=M.mlp_a_kernel, signature=s, constexprs=cons)
    else:
        src = GluonASTSource(fn=M.mlp_b_kernel, signature=s, constexprs=cons)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=4, num_stages=1))
    out = Path(f"/tmp/gsp/{triton.__version__}")
    regs, spill, sass = assemble(k.asm["ptx"], out, tag)
    (out / f"{tag}.ttgir").write_text(k.asm["ttgir"])
    n_ins = len(re.findall(r"/\*[0-9a-f]{4}\*/", sass))
    print(f"{tag}: regs {regs} spill_st {spill} shared {k.metadata.shared} "
          f"SASS {n_ins} HGMMA {sass.count('HGMMA')} DEPBAR {sass.count('WARPGROUP.DEPBAR')} "
          f"ARRIVE {sass.count('WARPGROUP.ARRIVE')} BAR.SYNC {sass.count('BAR.SYNC')}", flush=True)
which = sys.argv[1:] or ["A", "B0", "B1", "B0s", "B1s", "B0sh1", "B1sh1", "B1sh2", "B1h2"]
for w in which:
    try:
        if w in ("A", "A_h"):  # A_h: kernel A with float16 halves
            build(w, "A", F16=w == "A_h")
        else:
            # B<pipe>[s: layer-1 A in smem][h<HBUF>: layer-2 A in smem]
            build(w, "B", PIPE=w[1] == "1", A1_SMEM="s" in w, A2_SMEM="h" in w,
                  HBUF=int(w[-1]) if "h" in w else 2)
    except Exception as e:
        print(w, "FAILED:", type(e).__name__, str(e)[:3000])
