"""Copy golden cases from ../shared/parity into the package and (re)write the data manifest.

    python tools/bundle_traces.py            copy SHARED_CASES, refresh MANIFEST.json
    python tools/bundle_traces.py --check    verify the bundle; exit 1 on any mismatch

Users of the repository have no ../shared, so the cases the tests and ``xopt parity`` need
ship inside ``xopt/parity/data/<method>/``, unchanged (byte for byte) and with their
manifests. ``MANIFEST.json`` records each bundled file's SHA-256 and origin: a path under
``shared/parity/`` for golden cases recorded by the original authors' code, or the xopt
tool that recorded it (AdamW's cases, recorded from torch.optim and optax).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "xopt/parity/data"
SHARED = ROOT.parent / "shared/parity"

#: golden cases copied from ../shared/parity, as "<method>/<case>"
SHARED_CASES = [
    # every low-rank, CompAct and POET case (8.6 MB in all)
    "galore/adamw_left_r4_gap5",
    "galore/adamw_reverse_std_r4_gap5",
    "galore/adamw_right_r4_gap5",
    "galore/adamw_std_r4_gap5",
    "flora/flora_r4_kappa4",
    "coap/adafactor_r4_tu3_rf2",
    "coap/adamw_r4_tu3_rf2",
    "coap/adamw_r4_tu3_rf2_restore",
    "compact/linear_in32_out24_r0.25",
    "compact/llama2block_h16_r0.25",
    "poet/cayley_neumann_b16",
    "poet/cayley_neumann_b8",
    "poet/cayley_neumann_triton_b16",
    "poet/cayley_neumann_triton_b8",
    "poet/linear_in64_out48_b16",
    "poet/train_in64_out48_b16_merge4",
    # one case per learned optimizer (the repository cannot carry all 37 MB of them);
    # parity_tests/ runs every case from ../shared when it is present
    "small_fc_lopt/pylo_sizes_perturbed_seed0",
    "velo/perturbed_seed0",
]
#: cases recorded by xopt's own tools from the original libraries, by the start of their
#: path under xopt/parity/data
RECORDED = {"adamw/": "tools/record_adamw.py", "mulo/": "tools/record_mulo.py",
            "coap/conv_": "tools/record_coap_conv.py"}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def meta_files(case: str) -> list[str]:
    """The learned-optimizer weight files a shared case names (``meta/<name>.npz``)."""
    manifest = json.loads((SHARED / f"{case}.json").read_text())
    method = case.split("/", 1)[0]
    rels = [manifest.get("meta_params_file"), manifest.get("meta_params", {}).get("base_file")]
    return [f"{method}/{r}" for r in rels if r]


def build_manifest() -> dict:
    files = {}
    shared_meta = {m for case in SHARED_CASES for m in meta_files(case)} if SHARED.is_dir() \
        else set()
    for path in sorted(p for p in DATA.rglob("*.*") if p.name != "MANIFEST.json"):
        rel = path.relative_to(DATA).as_posix()
        method, name = rel.split("/", 1)
        case = name.rsplit(".", 1)[0]
        if f"{method}/{case}" in SHARED_CASES or rel in shared_meta:
            origin = f"shared/parity/{rel}"
        elif any(rel.startswith(k) for k in RECORDED):
            origin = next(v for k, v in RECORDED.items() if rel.startswith(k))
        else:
            raise SystemExit(f"{rel}: no known origin; add it to SHARED_CASES or RECORDED")
        files[rel] = {"sha256": sha256(path), "bytes": path.stat().st_size, "origin": origin}
    return {"format": "xopt-bundle/1", "files": files}


def main(argv: list[str]) -> int:
    if "--check" in argv:
        manifest = json.loads((DATA / "MANIFEST.json").read_text())
        bad = [rel for rel, entry in manifest["files"].items()
               if sha256(DATA / rel) != entry["sha256"]]
        print("bundle ok" if not bad else f"mismatch: {bad}")
        return 1 if bad else 0
    if not SHARED.is_dir():
        raise SystemExit(f"{SHARED} not found: run from a checkout with ../shared beside it")
    for case in SHARED_CASES:
        for rel in [f"{case}.json", f"{case}.npz", *meta_files(case)]:
            dst = DATA / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(SHARED / rel, dst)
    (DATA / "MANIFEST.json").write_text(json.dumps(build_manifest(), indent=1) + "\n")
    print(f"bundled {len(SHARED_CASES)} shared case(s); manifest: {DATA / 'MANIFEST.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
