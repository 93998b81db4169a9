"""The library type-checks and lints clean, as CI runs them: mypy over `ckpttool/` (config in
pyproject.toml) with no errors, ruff's pyflakes and bugbear rules with no findings, and the
package marks itself typed (PEP 561 `py.typed`, shipped as package data)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *command], cwd=ROOT, capture_output=True, text=True, timeout=900)


def test_mypy_finds_no_errors_in_the_library():
    result = run("mypy")
    assert result.returncode == 0 and "Success: no issues found" in result.stdout, result.stdout[-4000:] + result.stderr


def test_ruff_finds_nothing_in_the_library():
    result = run("ruff", "check", "ckpttool")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr


def test_the_package_says_it_is_typed():
    assert (ROOT / "ckpttool" / "py.typed").is_file()
    assert '"py.typed"' in (ROOT / "pyproject.toml").read_text()
