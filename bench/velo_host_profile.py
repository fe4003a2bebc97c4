"""Host-side profile of VeLO(impl='triton') steps on ViT-B/16 shapes (cProfile), and the
host time of one step (time from step() entry to return, GPU synced before)."""
import cProfile, pstats, sys, time, io
import torch
sys.path.insert(0, ".")
sys.path.insert(0, "bench")
from lopt_step import make, MODELS, VELO
import xopt.torch as xt
for model in ("vit_b16", "gpt2_medium"):
    params = make(MODELS[model]())
    opt = xt.VeLO(params, impl="triton", **VELO)
    loss = torch.tensor(1.0, device="cuda")
    for _ in range(5):
        opt.step(loss=loss)
    torch.cuda.synchronize()
    hs = []
    for _ in range(20):
        torch.cuda.synchronize()
        t0 = time.perf_counter(); opt.step(loss=loss); hs.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    hs.sort()
    print(f"{model}: host ms per step (GPU idle at entry) median {1e3*hs[10]:.3f} min {1e3*hs[0]:.3f}; mom_fallbacks {opt._triton.mom_fallbacks}")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(50):
        opt.step(loss=loss)
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
    print(s.getvalue()[:6000])
    del opt, params
    torch.cuda.empty_cache()
