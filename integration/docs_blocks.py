"""The code blocks of the README and the guides, as the example tests read them.

A block is a fenced ```python or ```bash block. The line right before it may say how it runs:
``<!-- not run: REASON -->`` (it cannot run in the suite, e.g. it needs eight GPUs: it is only
compiled, or checked with ``bash -n``) or ``<!-- file: NAME -->`` (a script: written to NAME in
the page's folder for a later bash block to run). ```text blocks are output and are not run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
GUIDES = ROOT / "docs" / "guides"
RUN_LANGUAGES = ("python", "bash")
LANGUAGES = (*RUN_LANGUAGES, "text")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)
MARK = re.compile(r"<!-- (not run|file): (.+?) -->\s*$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    language: str
    code: str
    not_run: str | None = None  # the reason it cannot run in the suite
    file: str | None = None  # a script the page's later blocks run

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def pages() -> list[Path]:
    """The README, then the guides: every page whose blocks must run."""
    return [README, ROOT / "docs" / "index.md", *sorted(GUIDES.glob("*.md"))]


def blocks(page: Path) -> list[Block]:
    """The page's fenced blocks, in page order, with what the line before each says."""
    text = page.read_text(encoding="utf-8")
    found = []
    for match in FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = MARK.search(before)
        found.append(Block(
            page, line, match.group(1), match.group(2),
            not_run=mark.group(2) if mark and mark.group(1) == "not run" else None,
            file=mark.group(2) if mark and mark.group(1) == "file" else None,
        ))
    return found
