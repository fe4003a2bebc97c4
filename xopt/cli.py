"""The ``xopt`` command line.

    xopt parity METHOD [--trace FILE ...] [--backends torch,jax,oracle,original]
                       [--against golden|original|torch|jax|oracle] [--mode teacher,closed]
                       [--impl plain|triton] [--device cpu|cuda] [--steps N]
                       [--json REPORT] [--plot PNG] [--quiet] [--localise]
                       [--world-size N [--sharding ddp,fsdp2]]
    xopt record IMPL [--problem NAME] [--steps N] [--seed S] [--case NAME] --out FILE
    xopt compare A B [--problem NAME] [--steps N] [--seed S] [--mode teacher,closed]
                     [--map B_STATE=A_STATE ...] [--tol REL] [--closed-tol REL]
                     [--json REPORT] [--plot PNG] [--record FILE]
    xopt compare --table PAGE [--check]
    xopt methods
    xopt port SRC DST [--to lo|pylo|xopt] [--verify] [--overwrite]
                      [--decays pylo-defaults|JSON] [--set FIELD=VALUE ...]

``xopt parity`` exits 0 when every run agrees within its stated tolerance (or, with a note,
when the method has no traces to replay), 1 when any diverges, and 2 on bad input (unknown
method, malformed trace, unknown hyperparameters, an unavailable backend that was asked for
by name), printing what is at fault.
``xopt record`` writes a trace of any torch.optim optimizer or optax transformation (IMPL:
a call such as ``"torch.optim.Adam(lr=1e-3)"`` or ``"optax.adam(1e-3)"``). ``xopt compare``
exits like ``xopt parity``; both exit 3 when no run diverges but some run is beyond its
tolerance while the implementation is closer to the exact (float64) result than the
reference. ``xopt compare --table`` writes the torch.optim-against-optax page
(``--check``: exit 1 if the page on disk differs beyond machine rounding).
``xopt port`` exits 0 when the checkpoint was written (and, with ``--verify``, behaves
identically), 1 when ``--verify`` finds a difference, 2 on bad input (a corrupt or unknown
checkpoint, a missing key, a non-finite value, an unsupported optimizer, a destination it
may not replace: see ``xopt.checkpoints.save``).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence

from xopt.errors import XoptError

EXIT_AGREE, EXIT_DIVERGE, EXIT_BAD_INPUT, EXIT_CLOSER_TO_EXACT = 0, 1, 2, 3


def _exit_code(verdict: str) -> int:
    return {"agree": EXIT_AGREE, "closer_to_exact": EXIT_CLOSER_TO_EXACT}.get(verdict,
                                                                             EXIT_DIVERGE)


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own exit code is already 2; keep the prefix
        self.print_usage(sys.stderr)
        self.exit(EXIT_BAD_INPUT, f"xopt: error: {message}\n")


def _csv(choices: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        items = [s.strip() for s in text.split(",") if s.strip()]
        bad = [s for s in items if s not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(
                f"{text!r}: choose from {', '.join(choices)} (comma-separated)")
        return items

    return parse


def _progress_factory(enabled: bool) -> Callable[[int], Callable[[], None]]:
    """A dependency-free progress bar on stderr (drawn only on a terminal)."""

    def make(total: int) -> Callable[[], None]:
        state = {"done": 0, "t0": time.monotonic(), "last": 0.0}
        draw = enabled and sys.stderr.isatty()

        def tick() -> None:
            state["done"] += 1
            now = time.monotonic()
            if not draw or (now - state["last"] < 0.1 and state["done"] < total):
                return
            state["last"] = now
            frac = state["done"] / max(total, 1)
            bar = "#" * int(30 * frac)
            sys.stderr.write(f"\r[{bar:<30}] {state['done']}/{total} steps "
                             f"{now - state['t0']:.1f}s")
            if state["done"] >= total:
                sys.stderr.write("\n")
            sys.stderr.flush()

        return tick

    return make


def _parity(args: argparse.Namespace) -> int:
    from xopt.parity import bundled_traces
    from xopt.parity.harness import MODES, run_parity
    from xopt.parity.methods import get as get_parity
    from xopt.parity.report import table

    parity = get_parity(args.method)  # unknown method: exit 2 before anything else
    if args.world_size is not None:
        return _parity_distributed(args)
    traces = args.trace or [str(p) for p in bundled_traces(args.method)]
    if not traces:
        # nothing to compare is not a divergence: a loop over `xopt methods` goes on
        why = ("it has no original implementation to record golden traces from; its tests "
               "check the paper's equations" if not parity.originals and parity.layer is None
               else "none are bundled")
        print(f"{args.method}: no traces to replay ({why}); pass --trace FILE to run one")
        return EXIT_AGREE
    report = run_parity(
        args.method, traces,
        backends=args.backends or ("torch", "jax", "oracle", "original"),
        explicit_backends=args.backends is not None,
        against=args.against, modes=[MODES[m] for m in args.mode], impl=args.impl,
        device=args.device, max_steps=args.steps,
        progress=_progress_factory(not args.quiet), localise=args.localise,
    )
    print(table(report))
    if args.aux:
        from xopt.parity.harness import aux_errors

        for path in traces:
            errs = aux_errors(args.method, path, max_steps=args.steps)
            if not errs:
                print(f"\n{path}: no recorded aux to compare")
                continue
            print(f"\ninternals of {args.method} (spec, NumPy float32) vs the recorded aux of "
                  f"{path}, teacher-forced (max relative error, step):")
            for k, (e, step) in errs.items():
                print(f"  {k:32s} {e:9.3g}  step {step}")
    return _finish(report, args)


def _finish(report, args: argparse.Namespace, show: bool = False) -> int:
    """Print the table (``show``), write ``--json``/``--plot``; the report's exit code."""
    from xopt.parity.report import table, write_json, write_plot

    if show:
        print(table(report))
    if args.json:
        print(f"report: {write_json(report, args.json)}")
    if args.plot:
        print(f"plot: {write_plot(report, args.plot)}")
    return _exit_code(report.verdict)


def _parity_distributed(args: argparse.Namespace) -> int:
    """``--world-size N``: the method's traces on N ranks (torch) and N devices (JAX)
    against one process (:mod:`xopt.parity.distributed`)."""
    from xopt.parity.distributed import run_distributed_parity
    from xopt.parity.harness import MODES

    backends = [b for b in (args.backends or ("torch", "jax")) if b in ("torch", "jax")]
    if not backends:
        raise XoptError("--world-size runs the torch and jax backends only")
    if args.against != "golden" or args.localise or args.aux or args.impl != "plain":
        raise XoptError("--world-size compares against the one-process run; it takes no "
                        "--against, --localise, --aux or --impl")
    report = run_distributed_parity(
        args.method, args.trace, world_size=args.world_size, backends=backends,
        shardings=args.sharding, modes=[MODES[m] for m in args.mode], max_steps=args.steps,
        device=args.device)
    return _finish(report, args, show=True)


def _record(args: argparse.Namespace) -> int:
    from xopt.parity.recorder import record

    rec = record(args.impl, args.problem, steps=args.steps, seed=args.seed, path=args.out,
                 case=args.case)
    print(f"{rec.manifest['source']['object']}: {rec.steps} steps on "
          f"{rec.manifest['case']} -> {args.out}")
    return EXIT_AGREE


def _mapping(items: Sequence[str] | None) -> dict[str, str]:
    out = {}
    for item in items or []:
        b, eq, a = item.partition("=")
        if not eq or not b or not a:
            raise XoptError(f"--map {item!r}: expected B_STATE=A_STATE (or B_STATE=@count)")
        out[b.strip()] = a.strip()
    return out


def _compare(args: argparse.Namespace) -> int:

    if args.table:
        if args.a or args.b:
            raise XoptError("--table takes no A and B")
        from xopt.parity.pairs import check_page, write_page

        if args.check:
            diffs = check_page(args.table)
            for d in diffs:
                print(d)
            print(f"{args.table}: " + ("differs" if diffs else "up to date"))
            return EXIT_DIVERGE if diffs else EXIT_AGREE
        print(f"wrote {write_page(args.table)}")
        return EXIT_AGREE
    if not (args.a and args.b):
        raise XoptError("compare needs A and B (a trace file or a call such as "
                        "'torch.optim.Adam(lr=1e-3)'), or --table PAGE")
    from xopt.parity.anyopt import TOLERANCES, compare
    from xopt.parity.methods import Tolerance

    tolerances = {}
    for mode, value in (("teacher_forced", args.tol), ("closed_loop", args.closed_tol)):
        if value is not None:
            tolerances[mode] = Tolerance(value, 0.0, "given on the command line; default: "
                                         + TOLERANCES[mode].why)
    report = compare(args.a, args.b, problem=args.problem, steps=args.steps, seed=args.seed,
                     modes=args.mode, mapping=_mapping(args.map), tolerances=tolerances,
                     record_to=args.record)
    return _finish(report, args, show=True)


def _methods(args: argparse.Namespace) -> int:
    from xopt import specs
    from xopt.parity import bundled_traces
    from xopt.parity.methods import get as get_parity

    for name in specs.names():
        spec = specs.get(name)
        originals = get_parity(name).originals
        print(f"{name}: {spec.title}")
        print(f"  presets: {', '.join(spec.presets)}; originals: {', '.join(originals)}; "
              f"bundled traces: {len(bundled_traces(name))}")
        print(spec.hyperparams.describe())
    return 0


def _port(args: argparse.Namespace) -> int:
    import json

    from xopt.checkpoints.port import port

    overrides = {}
    for item in args.set or []:
        field, eq, value = item.partition("=")
        if not eq or not field:
            raise XoptError(f"--set {item!r}: expected FIELD=VALUE")
        try:
            overrides[field] = json.loads(value)
        except json.JSONDecodeError:
            overrides[field] = value
    decays = args.decays
    if decays is not None and decays != "pylo-defaults":
        try:
            decays = json.loads(decays)
        except json.JSONDecodeError as e:
            raise XoptError(f"--decays: not 'pylo-defaults' or a JSON object ({e})") from None
    r = port(args.src, args.dst, args.to, verify=args.verify, overwrite=args.overwrite,
             decays=decays, overrides=overrides, method=args.method)
    print(f"{r.method}: {r.src_format} {args.src} -> {r.dst_format} {r.dst}")
    for name, digest in r.source.get("sha256", {}).items():
        print(f"source sha256: {digest}  {name}")
    for note in r.notes:
        print(f"note: {note}")
    if r.max_abs_diff is None:
        return EXIT_AGREE
    if r.max_abs_diff == 0.0:
        print("verify: identical (every parameter and state tensor, every step, bit for bit)")
        return EXIT_AGREE
    print(f"verify: DIFFERENT (max abs diff {r.max_abs_diff:g})")
    return EXIT_DIVERGE


def build_parser() -> argparse.ArgumentParser:
    from xopt import __version__

    parser = _ArgumentParser(prog="xopt", description="xopt: optimizers with JAX/PyTorch parity")
    parser.add_argument("--version", action="version", version=f"xopt {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_ArgumentParser)

    p = sub.add_parser("parity", help="run a method's implementations on traces and compare")
    p.add_argument("method", help="method name (see `xopt methods`)")
    p.add_argument("--trace", action="append", metavar="FILE",
                   help="trace manifest (.json) to run; repeatable (default: bundled traces)")
    p.add_argument("--backends", type=_csv(("torch", "jax", "oracle", "original")),
                   help="implementations to check (default: torch,jax,oracle,original)")
    p.add_argument("--against", default="golden",
                   choices=("golden", "original", "torch", "jax", "oracle"),
                   help="the reference each backend is compared with (default: golden)")
    p.add_argument("--mode", type=_csv(("teacher", "closed")), default=["teacher", "closed"],
                   help="teacher-forced and/or closed-loop (default: teacher,closed)")
    p.add_argument("--impl", default="plain", choices=("plain", "triton"),
                   help="torch implementation (default: plain)")
    p.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    p.add_argument("--steps", type=int, default=None, help="only the first N steps")
    p.add_argument("--json", metavar="REPORT", help="write the JSON report here")
    p.add_argument("--plot", metavar="PNG", help="write a PNG of error against step here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--localise", action="store_true",
                   help="name each teacher-forced run's first step and tensor above float32 "
                        "rounding and the side further from the float64 oracle (reruns "
                        "the oracle on perturbed inputs where needed)")
    p.add_argument("--aux", action="store_true",
                   help="also compare the spec's internals (float32) with each trace's "
                        "recorded aux, teacher-forced, to localize a divergence")
    p.add_argument("--world-size", type=int, metavar="N",
                   help="replay the traces on N ranks (torch: gloo on the CPU, NCCL "
                        "with --device cuda; jax: N devices, host devices on the CPU) with "
                        "the gradient (layer traces: the batch's rows) split across them, "
                        "against one process")
    p.add_argument("--sharding", type=_csv(("ddp", "fsdp2")), default=["ddp", "fsdp2"],
                   help="with --world-size, the torch wrappers (default: ddp,fsdp2)")
    p.set_defaults(func=_parity)

    r = sub.add_parser("record", help="record a trace of any torch.optim optimizer or optax "
                                      "transformation")
    r.add_argument("impl", help="a call: 'torch.optim.Adam(lr=1e-3)', 'optax.adam(1e-3)', "
                                "'package.module:factory(...)'")
    r.add_argument("--problem", default="mlp",
                   help="bundled problem (mlp, mlp-nobias, linear) or module:attr of a "
                        "xopt.parity.Problem (default: mlp)")
    r.add_argument("--steps", type=int, default=20, help="updates to record (default: 20)")
    r.add_argument("--seed", type=int, default=0, help="the problem's seed (default: 0)")
    r.add_argument("--case", help="the trace's case name (default: <problem>_seed<seed>)")
    r.add_argument("--out", "-o", required=True, metavar="FILE",
                   help="manifest path (<case>.json; the arrays go beside it as .npz)")
    r.set_defaults(func=_record)

    c = sub.add_parser("compare", help="compare an implementation with a trace or another "
                                       "implementation (B against the reference A)")
    c.add_argument("a", nargs="?", help="reference: trace manifest (.json) or a call")
    c.add_argument("b", nargs="?", help="implementation under test: a call (or a trace whose "
                                        "manifest names its call)")
    c.add_argument("--problem", default="mlp", help="problem to record A on when A is a call")
    c.add_argument("--steps", type=int, default=None,
                   help="steps (default: the trace's, or 20 when A is recorded here)")
    c.add_argument("--seed", type=int, default=0, help="the problem's seed (default: 0)")
    c.add_argument("--mode", type=_csv(("teacher", "closed")), default=["teacher", "closed"],
                   help="teacher-forced and/or closed-loop (default: teacher,closed)")
    c.add_argument("--map", action="append", metavar="B_STATE=A_STATE",
                   help="feed B's state key or variable from A's (or =@count, the number "
                        "of updates); repeatable")
    c.add_argument("--tol", type=float, help="teacher-forced relative tolerance "
                                             "(default: 1e-6)")
    c.add_argument("--closed-tol", type=float, help="closed-loop relative tolerance "
                                                    "(default: 1e-5)")
    c.add_argument("--json", metavar="REPORT", help="write the JSON report here")
    c.add_argument("--plot", metavar="PNG", help="write a PNG of error against step here")
    c.add_argument("--record", metavar="FILE", help="also write A's trace here, when A is "
                                                    "recorded")
    c.add_argument("--table", metavar="PAGE",
                   help="write the torch.optim-against-optax page here instead")
    c.add_argument("--check", action="store_true",
                   help="with --table: compare the page on disk with a fresh run")
    c.set_defaults(func=_compare)

    m = sub.add_parser("methods", help="list the registered methods and their hyperparameters")
    m.set_defaults(func=_methods)

    q = sub.add_parser("port", help="convert a learned-optimizer checkpoint between formats")
    q.add_argument("src", help="checkpoint directory (format detected)")
    q.add_argument("dst", help="directory to write (atomically)")
    q.add_argument("--to", default="xopt", choices=("lo", "learned_optimization", "pylo", "xopt"),
                   help="destination format (default: xopt)")
    q.add_argument("--verify", action="store_true",
                   help="run source and result on a synthetic trace and compare bit for bit")
    q.add_argument("--overwrite", action="store_true",
                   help="replace an existing DST directory that holds only checkpoint files "
                        "(never '.', a link, a file, or a directory containing SRC)")
    q.add_argument("--decays", help="small_fc_lopt decay offsets for a PyLO source (PyLO "
                                    "does not store them): 'pylo-defaults' or a JSON object")
    q.add_argument("--set", action="append", metavar="FIELD=VALUE",
                   help="hyperparameter override (JSON value); repeatable")
    q.add_argument("--method", help="the method SRC must hold; 'mulo' reads a PyLO MetaMLP "
                                    "as μLO's (the folder serves small_fc_lopt and μLO)")
    q.set_defaults(func=_port)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except XoptError as e:
        print(f"xopt: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
