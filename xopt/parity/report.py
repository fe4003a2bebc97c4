"""Presenting a parity :class:`~xopt.parity.harness.Report`: table, JSON file, PNG plot."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from xopt._atomic import atomic_path
from xopt.errors import XoptError
from xopt.parity.harness import Report


def _fmt(x: float) -> str:
    if x is None:
        return "-"
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf"
    return "0" if x == 0 else f"{x:.2e}"


def table(report: Report) -> str:
    """A fixed-width table, one row per run, with the verdict last."""
    head = ("trace", "backend", "impl", "against", "mode", "steps", "max abs", "max rel",
            "worst (step: tensor)", "tol rel", "oracle closer", "from exact (b | a)", "verdict")
    rows = []
    exceptions: dict[tuple[str, float], str] = {}
    for r in report.runs:
        t, k, _ = r.worst
        tol = r.tolerance.for_tensor(k)
        mark = ""
        if tol is not r.tolerance:  # the worst tensor is one of the spec's named exceptions
            prefix = next(p for p, v in r.tolerance.tensors.items() if v is tol)
            exceptions[prefix, tol.rel] = f"{prefix}* within {_fmt(tol.rel)} rel: {tol.why}"
            mark = "*"
        verdict = {"agree": "agree", "diverge": "DIVERGE",
                   "closer_to_exact": "CLOSER TO EXACT"}[r.verdict]
        if r.agrees and r.max_abs_error == 0.0:
            verdict = "agree (bitwise)"
        exact = "-" if r.backend_to_exact is None else \
            f"{_fmt(r.backend_to_exact)} | {_fmt(r.against_to_exact)}"
        rows.append((r.trace.split("/", 1)[-1], r.backend, r.impl, r.against,
                     r.mode.replace("_", "-"), str(r.steps), _fmt(r.max_abs_error),
                     _fmt(r.max_rel_error), f"{t}: {k}" if k else "-",
                     "bitwise" if tol.rel == 0 and tol.abs == 0 else _fmt(tol.rel) + mark,
                     r.oracle_agrees_with or "-", exact, verdict))
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h)
              for i, h in enumerate(head)]
    line = "  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    out.append("")
    for text in exceptions.values():
        out.append(f"* {text}")
    for r in report.runs:
        if r.localisation is not None:
            out.append(f"{r.trace.split('/', 1)[-1]} {r.backend} vs {r.against} "
                       f"{r.mode.replace('_', '-')}: {r.localisation.summary()}")
    closer = [r for r in report.runs if r.verdict == "closer_to_exact"]
    for r in closer:
        out.append(f"closer to exact: {r.trace.split('/', 1)[-1]} {r.backend} vs {r.against} "
                   f"{r.mode.replace('_', '-')}: beyond tolerance, but {r.backend} is "
                   f"{_fmt(r.backend_to_exact)} from the {r.exact_estimate} where "
                   f"{r.against} is {_fmt(r.against_to_exact)}: the excess is the "
                   f"reference's own rounding"
                   + (f" (undecided, equally far or too sensitive a step: "
                      f"{', '.join(r.undecided)})" if r.undecided else ""))
    for note in report.notes:
        out.append(f"note: {note}")
    n_bad = sum(r.verdict == "diverge" for r in report.runs)
    counts = [f"{n_bad} diverge"] if n_bad else []
    if closer:
        counts.append(f"{len(closer)} beyond tolerance but closer to exact than the reference")
    n, t = len(report.runs), len(report.traces)
    out.append(f"{report.method}: {n} run{'s' * (n != 1)} on {t} trace{'s' * (t != 1)}; "
               f"verdict: {report.verdict}" + (f" ({'; '.join(counts)})" if counts else ""))
    return "\n".join(out)


def write_json(report: Report, path: str | os.PathLike[str]) -> Path:
    """Write the report (atomically). Non-finite errors are written as JSON's
    ``Infinity``/``NaN`` extensions, which Python's json reads back."""
    path = Path(path)
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        f.write(json.dumps(report.to_json(), indent=1) + "\n")
    return path


def write_plot(report: Report, path: str | os.PathLike[str]) -> Path:
    """Max relative error (over tensors) against step, log scale, one line per run."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise XoptError("--plot needs matplotlib (pip install 'xopt-ml[plot]')") from e
    path = Path(path)
    modes = sorted({r.mode for r in report.runs})
    fig, axes = plt.subplots(1, max(len(modes), 1), figsize=(6.5 * max(len(modes), 1), 4.5),
                             squeeze=False)
    floor = 1e-12  # where bitwise-equal runs are drawn on the log axis
    for ax, mode in zip(axes[0], modes, strict=True):
        for r in (r for r in report.runs if r.mode == mode):
            ys = [max((e.rel for e in errs.values()), default=0.0) for errs in r.per_step]
            ys = [floor if y == 0 else (1e3 if not math.isfinite(y) else y) for y in ys]
            ax.plot(range(len(ys)), ys, marker=".", linewidth=1,
                    label=f"{r.backend} vs {r.against} ({r.trace.split('/', 1)[-1]})")
        tols = {r.tolerance.rel for r in report.runs if r.mode == mode and r.tolerance.rel > 0}
        for tol in sorted(tols):
            ax.axhline(tol, color="grey", linestyle="--", linewidth=0.8)
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("max relative error over tensors (bitwise drawn at 1e-12)")
        ax.set_title(f"{report.method}: {mode.replace('_', '-')}")
        ax.legend(fontsize=6, loc="best")
    fig.tight_layout()
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=110, format="png")
    finally:
        plt.close(fig)
    return path
