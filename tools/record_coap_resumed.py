"""Record a COAP trace of the authors' CoapAdamW, resumed from its state dict mid-run.

    PYTHONPATH=/path/to/tensorly-and-bitsandbytes:/path/to/coap \
        python tools/record_coap_resumed.py [OUT_DIR]     (default: tests/fixtures/parity/coap)

Issue 29's finding 1 (tests/test_parity_findings.py): ``coap_torch.CoapAdamW`` (the
authors' code, https://github.com/bytedance/coap at deabc3a, imported from a checkout) with
rank 6, update interval 4, reprojection factor 3 and ``restore_state=True``, on the bundled
``linear``-style regression widened to a tanh MLP (16 → 24 → 12, xopt.parity.recorder's
``_Regression``, seed 1, parameters scaled by 1e-3 so that an update is not small against
its parameter), for 16 steps; after 8 steps the optimizer is rebuilt and
``load_state_dict(state_dict())`` resumes it. Step 12 refreshes P by QR and SVD (Eqn 7)
and carries the moments to the new subspace.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from xopt.parity.recorder import TorchImplementation, _Regression, record  # noqa: E402

CTOR = dict(lr=0.01, betas=[0.9, 0.999], eps=1e-6, weight_decay=0.0, correct_bias=True,
            proj_method="coap", rank=6, update_interval=4, reproject_factor=3, scale=0.25,
            restore_state=True)
RESUME, STEPS, SEED, SCALE = 8, 16, 1, 1e-3


def main(out_dir: Path) -> Path:
    import coap_torch
    import torch

    def make(ps):
        return coap_torch.CoapAdamW(ps, **{**CTOR, "betas": tuple(CTOR["betas"])})

    class Resumed(TorchImplementation):
        n = 0

        def step(self, grads, loss):
            if self.n == RESUME:  # a new optimizer, resumed from the old one's state dict
                sd = self.opt.state_dict()
                self.opt = self.factory(self.tensors)
                self.opt.load_state_dict(sd)
            super().step(grads, loss)
            self.n += 1

    prob = _Regression("mlp", SEED, hidden=24, bias=True, d_in=16, d_out=12)
    prob._init = {k: (v * SCALE).astype(np.float32) for k, v in prob._init.items()}
    names = list(prob.init_params())
    # the groups coap_torch's setup_params makes, by name (the harness reads them)
    ts = [torch.zeros(v.shape, requires_grad=True) for v in prob.init_params().values()]
    name_of = {id(t): n for t, n in zip(ts, names, strict=True)}
    groups = []
    for g in make(ts).param_groups:
        d = {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"}
        d["params"] = [name_of[id(p)] for p in g["params"]]
        groups.append(d)
    hp = {"optimizer_class": "CoapAdamW", "constructor": CTOR, "effective_param_groups": groups}
    case = f"adamw_r6_tu4_rf3_resumed{RESUME}_seed{SEED}"
    out_dir.mkdir(parents=True, exist_ok=True)
    rec = record(Resumed(make, "coap_torch.CoapAdamW"), prob, steps=STEPS,
                 path=out_dir / f"{case}.json", case=case, method="coap", hyperparameters=hp)
    rec.manifest["source"].update(repo="https://github.com/bytedance/coap", commit="deabc3a")
    rec.manifest["source"]["notes"].append(
        f"coap_torch from https://github.com/bytedance/coap at deabc3a on PYTHONPATH; "
        f"resumed at step {RESUME} through state_dict()/load_state_dict(); parameters "
        f"initialised at {SCALE} times the problem's")
    return rec.write(out_dir / f"{case}.json")


if __name__ == "__main__":
    print(main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "tests/fixtures/parity/coap"))
