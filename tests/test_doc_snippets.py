"""Every code example in the documentation (docs/**/*.md) and the README runs.

Each page's fenced ``python`` blocks run in order in one namespace (a later block may use
what an earlier one defined), in a temporary working directory, at the sizes written on
the page (tiny ones). Each ``bash`` block whose lines are all ``xopt ...`` commands runs
too, as ``python -m xopt ...`` in the same directory, and must exit 0.

Markers, HTML comments on the line right above a block (not shown on the site):

* ``<!-- skip: REASON -->``: the block is not run (it needs a GPU, the network, or the
  original code); the test reports the reason. Kept for the few blocks that need it.

and a hidden block of set-up code, run where it stands and not shown on the site::

    <!-- setup
    import torch
    -->
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import REPO, has_jax, has_torch

PAGES = sorted(p for p in (REPO / "docs").rglob("*.md") if "_ext" not in p.parts)
PAGES.append(REPO / "README.md")

_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```"
                    r"[ \t]*$", re.S | re.M)
_SKIP = re.compile(r"<!--\s*skip:\s*(?P<reason>.*?)\s*-->\s*$")
_SETUP = re.compile(r"^<!--\s*setup\s*\n(?P<body>.*?)^-->", re.S | re.M)


@dataclass
class Snippet:
    page: Path
    line: int
    lang: str  # "python", "bash", or "setup" (a hidden python block)
    code: str
    skip: str | None = None


def snippets(page: Path) -> list[Snippet]:
    text = page.read_text()
    found = []
    for m in _FENCE.finditer(text):
        lang = m.group("lang")
        if lang not in ("python", "bash", "sh"):
            continue
        line = text.count("\n", 0, m.start()) + 1
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = _SKIP.search(before)
        found.append(Snippet(page, line, "python" if lang == "python" else "bash",
                             textwrap.dedent(m.group("body")),
                             skip.group("reason") if skip else None))
    for m in _SETUP.finditer(text):
        found.append(Snippet(page, text.count("\n", 0, m.start()) + 1, "setup",
                             textwrap.dedent(m.group("body"))))
    return sorted(found, key=lambda s: s.line)


_EXITS = re.compile(r"#\s*exits\s+(\d+)")


def _xopt_commands(code: str) -> list[tuple[str, int]] | None:
    """``(command, expected exit code)`` for each line of a shell block if every one is an
    ``xopt`` command, else None. A line's comment ``# exits N`` declares a non-zero code
    (a comparison shown because it diverges)."""
    out = []
    for raw in code.splitlines():
        cmd, _, comment = raw.partition("#")
        if cmd.strip():
            m = _EXITS.match("#" + comment) if comment else None
            out.append((cmd.strip(), int(m.group(1)) if m else 0))
    return out if out and all(c.startswith("xopt ") for c, _ in out) else None


def test_every_page_has_runnable_examples():
    """The snippet collection itself: method pages show torch and JAX, and only a few
    blocks are skipped (each with its reason)."""
    all_snips = [s for p in PAGES for s in snippets(p)]
    assert len([s for s in all_snips if s.lang == "python"]) >= 30
    skipped = [s for s in all_snips if s.skip]
    assert len(skipped) <= 8, [(s.page.name, s.line) for s in skipped]
    assert all(s.skip for s in skipped)
    for page in (REPO / "docs" / "methods").glob("*.md"):
        if page.name == "index.md":
            continue
        code = "\n".join(s.code for s in snippets(page) if s.lang == "python" and not s.skip)
        assert "xopt.torch" in code and "xopt.jax" in code, page.name


@pytest.mark.skipif(not (has_torch and has_jax), reason="needs torch and jax")
@pytest.mark.parametrize("page", [p for p in PAGES if snippets(p)],
                         ids=lambda p: str(p.relative_to(REPO)))
def test_page_examples_run(page: Path, tmp_path, monkeypatch):
    snips = snippets(page)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__docs__"}
    skipped = []
    for s in snips:
        where = f"{page.relative_to(REPO)}:{s.line}"
        if s.skip:
            skipped.append(f"{where}: {s.skip}")
            continue
        if s.lang == "bash":
            commands = _xopt_commands(s.code)
            if commands is None:
                continue  # an install or a script run: not an xopt command
            env = dict(os.environ)
            env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
            for cmd, expected in commands:
                proc = subprocess.run([sys.executable, "-m", "xopt", *shlex.split(cmd)[1:]],
                                      capture_output=True, text=True, env=env)
                assert proc.returncode == expected, (f"{where}: `{cmd}` exited {proc.returncode}\n"
                                              + proc.stdout[-2000:] + proc.stderr[-2000:])
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                exec(compile(s.code, where, "exec"), namespace)  # noqa: S102
        except Exception as e:
            raise AssertionError(f"{where}: the example raised {type(e).__name__}: {e}") from e
    if skipped:
        print("skipped examples:\n" + "\n".join(skipped))
