"""The README's two opening commands are the ones CI and users run."""

from __future__ import annotations

import re

from helpers import REPO


def _readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    block = re.search(r"```(?:bash|sh)\n(.*?)```", text, re.S)
    assert block, "README must open with a shell block"
    return [line for line in block.group(1).splitlines() if line and not line.startswith("#")]


def test_readme_opens_with_install_and_test_commands():
    install_and_run, test = _readme_commands()[:2]
    assert "xopt parity adamw" in install_and_run and "pip install" in install_and_run
    # the suite on up to 4 cores (pytest-xdist, in the dev group), one test file per worker
    # (each file's module fixtures, e.g. the kernel tests' child processes, run once)
    assert test.endswith("python -m pytest -n auto --maxprocesses 4 --dist loadfile")


def test_ci_runs_exactly_the_readme_test_command():
    ci_lines = [line for line in (REPO / ".ci/run").read_text().splitlines() if line.strip()]
    assert ci_lines[-1] == _readme_commands()[1]
