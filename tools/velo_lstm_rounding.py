"""How far the original's own float32 LSTM step and loss features are from exact arithmetic.

    python tools/velo_lstm_rounding.py [TRACE.json ...]     (default: every VeLO case
                                                             in ../shared, else bundled)

For every recorded update, the LSTM step is recomputed in float64 from exactly the inputs
the original gave it (the recorded ``aux/lstm_features`` and the recorded LSTM state
before the update) and compared with the LSTM state the original recorded after it. The
difference is the original's float32 rounding, chiefly in the 1024-term dot products of
the gate matrix, which XLA sums in its own order. Any other correct float32
implementation (torch's sums in another order) lands within about this distance of the
exact value, so up to about twice it from the original. Printed: the largest relative
error (max|a-b| / max|b| per tensor's row, the harness's metric) over all updates, and the
original's own jit-vs-op-by-op spread the recorder measured (the manifest's
``tolerance_hint``), for scale.

The loss features are measured the same way: one loss-buffer update and the 9 features in
float64 from the recorded buffer before the update and the recorded loss, against the
features the original passed to its LSTM (max absolute difference; plain HyperV2 traces).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from xopt.parity import bundled_traces, load_trace  # noqa: E402
from xopt.parity.methods import velo as velo_parity  # noqa: E402
from xopt.specs import velo  # noqa: E402


def rel(a: np.ndarray, b: np.ndarray) -> float:
    scale = np.abs(b).max()
    return float(np.abs(a - b).max() / scale) if scale > 0 else 0.0


def loss_feature_gap(t) -> float | None:
    """Max |features_f64 - features_original| over the updates (None for prefab traces)."""
    if "HyperV2" in t.hyperparameters:
        return None
    worst = 0.0
    pre = "init/state/loss_buffer/"
    for s in range(t.steps):
        st = {k: t.array(pre + k).astype(np.float64) for k in ("means", "running_min",
                                                                "decays")}
        it = int(t.array(pre + "iteration"))
        means, rmin = velo.loss_buffer_update(np, st["means"], st["running_min"], st["decays"],
                                              it, np.float64(t.loss(s)))
        f = velo.loss_features(np, means, rmin, st["decays"], it + 1)
        recorded = t.array(f"step_{s:04d}/aux/lstm_features")[0, 9:18]  # sorted keys:
        worst = max(worst, float(np.abs(f - recorded).max()))  # fraction_left, loss_features
        pre = f"step_{s:04d}/state/loss_buffer/"
    return worst


def measure(path: str) -> tuple[float, float]:
    t = load_trace(path)
    hp = velo_parity.from_hyperv2_kwargs(
        {**t.hyperparameters, "num_training_steps": t.num_training_steps}) \
        if "HyperV2" not in t.hyperparameters else None
    theta = velo.meta_from_original(t.meta_params(), hp or velo.VeLO(num_training_steps=1))
    meta = {k: np.asarray(v, np.float64) for k, v in theta.items()}
    inner = "inner_opt_state/" if any(k.startswith("init/state/inner_opt_state/")
                                      for k in t.keys()) else ""
    worst_h = worst_c = 0.0
    prev = {k: t.array(f"init/state/{inner}lstm_hidden_state/{k}") for k in ("hidden", "cell")}
    for s in range(t.steps):
        after = {k: t.array(f"step_{s:04d}/state/{inner}lstm_hidden_state/{k}")
                 for k in ("hidden", "cell")}
        if t.has(f"step_{s:04d}/aux/lstm_features"):  # an update ran at this step
            x = t.array(f"step_{s:04d}/aux/lstm_features").astype(np.float64)
            _, _, h, c = velo.lstm_step(np, x, prev["hidden"].astype(np.float64),
                                        prev["cell"].astype(np.float64), meta)
            for i in range(h.shape[0]):
                worst_h = max(worst_h, rel(h[i], after["hidden"][i]))
                worst_c = max(worst_c, rel(c[i], after["cell"][i]))
        prev = after
    return worst_h, worst_c


def main(argv: list[str]) -> int:
    shared = sorted((ROOT.parent / "shared/parity/velo").glob("*.json"))
    paths = argv or [str(p) for p in (shared or bundled_traces("velo"))]
    for p in paths:
        h, c = measure(p)
        t = load_trace(p)
        hint = t.manifest.get("tolerance_hint", {}).get("jit_vs_op_by_op", "-")
        lf = loss_feature_gap(t)
        print(f"{Path(p).stem:28s} exact vs original: LSTM hidden {h:.3g}, cell {c:.3g} "
              f"(relative); loss features {'-' if lf is None else f'{lf:.3g}'} (absolute)")
        print(f"{'':28s} original jit vs op-by-op (recorder): {hint}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
