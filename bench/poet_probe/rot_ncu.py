"""What bounds the fast layer's block products at 4096², b = 512 (twelfth session): run each
once between ``cudaProfilerStart``/``Stop`` for Nsight Compute, and (``--memsets``) which
host ops launch the fast layer's memsets. bf16, 4096 tokens.

    ncu --profile-from-start off --set full -o rot python3 bench/poet_probe/rot_ncu.py
    python3 bench/poet_probe/rot_ncu.py --memsets --time
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tma_rot  # noqa: E402
from graph_time import fwd_bwd, gtime  # noqa: E402

from xopt.kernels import poet_perm as PP  # noqa: E402
from xopt.torch.poet import POETLinear, _outer, _rotate  # noqa: E402

dev, dt = torch.device("cuda"), torch.bfloat16
T = n = 4096


def products(b):
    nb = n // b
    x = torch.randn(T, n, device=dev, dtype=dt)
    g = torch.randn(T, n, device=dev, dtype=dt)
    r = (torch.randn(nb, b, b, device=dev) / b**0.5).to(dt)
    perm = torch.randperm(n, device=dev).to(torch.int32)
    calls = {
        "rot": lambda: _rotate(x, r),
        "rotT": lambda: _rotate(x, r, transpose=True),
        "outer": lambda: _outer(x, g, nb),
        "tma_rot": lambda: tma_rot.rot(x, r, False, 128, 256, 64, 8, 3, True, False),
        "copy": lambda: x.clone(),
        "gather": lambda: PP.gather(x, perm),
    }
    return calls


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--b", type=int, default=512)
    ap.add_argument("--memsets", action="store_true")
    ap.add_argument("--time", action="store_true")
    args = ap.parse_args()
    calls = products(args.b)
    for f in calls.values():
        f()
    torch.cuda.synchronize()
    if args.time:
        for k, f in calls.items():
            print(f"{k}: {gtime(f):.1f} us", flush=True)
    if not args.memsets:
        torch.cuda.profiler.start()
        for f in calls.values():
            f()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        return
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(T, n, device=dev, dtype=dt, requires_grad=True)
    gy = torch.randn(T, n, device=dev, dtype=dt)
    layer = POETLinear(n, n, args.b, variant="fast", impl="triton", device=dev, dtype=dt)
    f = fwd_bwd(layer, x, gy)
    f()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        f()
        torch.cuda.synchronize()
    for e in p.events():
        if "emset" in e.name and e.device_type != torch.autograd.DeviceType.CUDA:
            chain, q = [], e
            while q is not None:
                chain.append(q.name)
                q = q.cpu_parent
            print("memset from:", " <- ".join(chain[:6]), flush=True)


if __name__ == "__main__":
    main()
