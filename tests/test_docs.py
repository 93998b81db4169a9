"""The README and docs/ stay true: every relative link resolves (file and heading), and every
command block marked `<!-- runnable -->` runs in a scratch directory beside the bundled
fixtures and exits 0."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
RUNNABLE = re.compile(r"<!-- runnable -->\n```bash\n(.*?)\n```", re.S)
README_LINES = 300


def slug(title: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but `-` and `_` dropped, spaces as `-`."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def headings(page: Path) -> set[str]:
    text, fence, found = page.read_text(), False, set()
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and (match := re.match(r"^#+ (.*)", line)):
            found.add(slug(match.group(1)))
    return found


def outside_code(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.S)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_to_a_file_and_heading(page):
    for target in LINK.findall(outside_code(page.read_text())):
        if re.match(r"^[a-z]+:", target):
            continue  # http(s), mailto: not checked (no network in tests)
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), f"{page.name}: {target} names a missing file"
        if anchor and linked.suffix == ".md":
            assert anchor in headings(linked), f"{page.name}: {target} names no heading of {linked.name}"


def test_the_readme_is_short_and_keeps_its_two_commands_between_their_markers():
    text = (ROOT / "README.md").read_text()
    assert text.count("\n") <= README_LINES
    for marker in ("main-command", "test-command"):
        block = re.search(rf"<!-- {marker} -->\n```bash\n(.+)\n```\n<!-- /{marker} -->", text)
        assert block and block.group(1).startswith("python3 -m venv .venv && . .venv/bin/activate && pip install -q torch==2.13.0")


BLOCKS = [(page, block) for page in PAGES for block in RUNNABLE.findall(page.read_text())]


@pytest.mark.parametrize("page,block", BLOCKS, ids=[f"{p.name}:{i}" for i, (p, _) in enumerate(BLOCKS)])
def test_runnable_blocks_run(tmp_path, page, block):
    (tmp_path / "fixtures").symlink_to(ROOT / "fixtures")
    bin_dir = str(Path(sys.executable).parent)
    environment = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, env=environment,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{page.name}:\n{block}\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"


def test_there_are_runnable_blocks_in_the_docs():
    assert len(BLOCKS) >= 3
