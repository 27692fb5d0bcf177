"""README.md and docs/*.md say what runs: their links resolve and their commands run as written.

Every ```bash / ```python block carries a marker on the line before its fence: `<!-- cpu -->`
(run here, against one server started as `make serve` starts it, with `127.0.0.1:8000` rewritten
to its address), `<!-- gpu -->` (needs an NVIDIA GPU) or `<!-- manual -->` (runs on a CPU but not
in a test: it starts servers, runs for minutes or downloads). docs/development.md says so too.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from live_server import live_server

ROOT = Path(__file__).resolve().parents[1]
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
MARKERS = ("cpu", "gpu", "manual")
RUNNABLE = ("bash", "python")
FENCE = re.compile(r"^(`{3,})(\S*)\s*$")
MARKER = re.compile(r"^<!-- (\w+) -->$")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
DEFAULT_ADDRESS = "127.0.0.1:8000"


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    marker: str | None
    code: str

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


@dataclass(frozen=True)
class Page:
    blocks: tuple[Block, ...]
    prose: str  # the page without its fenced blocks
    anchors: frozenset[str]  # GitHub's ids of its headings


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def parse(page: Path) -> Page:
    lines = page.read_text().splitlines()
    blocks, prose, anchors = [], [], set()
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            prose.append(lines[i])
            if lines[i].startswith("#"):
                anchors.add(slug(lines[i].lstrip("#")))
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith(fence.group(1)))
        marker = MARKER.match(lines[i - 1]) if i else None
        blocks.append(Block(page, i + 1, fence.group(2), marker and marker.group(1), "\n".join(lines[i + 1:end])))
        i = end + 1
    return Page(tuple(blocks), "\n".join(prose), frozenset(anchors))


PARSED = {page: parse(page) for page in PAGES}
ALL_BLOCKS = [b for p in PARSED.values() for b in p.blocks]
CPU_BLOCKS = [b for b in ALL_BLOCKS if b.marker == "cpu"]


def relative_links() -> list[tuple[Path, str]]:
    return [(page, target) for page, parsed in PARSED.items() for target in LINK.findall(parsed.prose)
            if not re.match(r"^[a-z]+:", target)]


def test_every_relative_link_points_to_an_existing_file() -> None:
    missing = [f"{page.name}: {target}" for page, target in relative_links()
               if target.split("#")[0] and not (page.parent / target.split("#")[0]).exists()]
    assert not missing


def test_every_link_anchor_names_a_heading_of_its_page() -> None:
    broken = []
    for page, target in relative_links():
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if anchor and dest.suffix == ".md" and anchor not in parse(dest).anchors:
            broken.append(f"{page.name}: {target}")
    assert not broken


def test_every_shell_and_python_block_says_where_it_runs() -> None:
    unmarked = [b.name for b in ALL_BLOCKS if b.lang in RUNNABLE and b.marker not in MARKERS]
    assert not unmarked, f"mark each with one of {MARKERS} on the line before its fence"


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """One server for every snippet, as `make serve` starts it (the embedded model, defaults)."""
    with live_server(timeout_s=480) as (base, _proc):  # a generous start on a busy machine
        yield base


@pytest.mark.slow
@pytest.mark.parametrize("block", CPU_BLOCKS, ids=lambda b: b.name)
def test_cpu_snippet_runs_against_the_served_model(block: Block, server: str) -> None:
    code = block.code.replace(DEFAULT_ADDRESS, server.removeprefix("http://"))
    venv_bin = os.path.dirname(sys.executable)  # `flashserve` and friends, as from .venv/bin
    env = dict(os.environ, PATH=os.pathsep.join((venv_bin, os.environ.get("PATH", ""))))
    command = ["bash", "-euo", "pipefail", "-c", code] if block.lang == "bash" else [sys.executable, "-c", code]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{block.name} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
