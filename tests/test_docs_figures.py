"""Every figure about speed in the guides and the README comes from a measurement kept in
``bench/results/``: a paragraph (or a table with the paragraph before it) that states a time,
a rate, a ratio or a comparison of speed names the results file it was taken from, and that
file exists. A claim whose measurement is gone, or never was, fails here."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = sorted([*(ROOT / "docs" / "guides").glob("*.md"), ROOT / "docs" / "index.md", ROOT / "README.md"])
FIGURE = re.compile(
    r"\d[\d,.]*\s?(?:us|µs|ms)\b"  # a time
    r"|\d[\d,.]*\s?(?:[A-Za-z]+)?/s\b"  # a rate: 1,800 samples/s, 90 MB/s
    r"|\d+(?:\.\d+)?[x×](?![\w(])"  # a ratio: 1.36x
    r"|\b(?:faster|slower|a fraction of|about half|times (?:less|more|fewer))\b", re.IGNORECASE)
CITED = re.compile(r"bench/results/([\w.-]+\.(?:md|json|png))")


def blocks(text: str) -> list[str]:
    """Paragraphs outside code, a table joined to the paragraph that introduces it."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    out: list[str] = []
    for block in re.split(r"\n\s*\n", text):
        if block.lstrip().startswith("|") and out:
            out[-1] += "\n" + block
        else:
            out.append(block)
    return out


def claims(path: pathlib.Path) -> list[str]:
    return [block for block in blocks(path.read_text()) if FIGURE.search(block)]


@pytest.mark.parametrize("path", PAGES, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_speed_figure_cites_the_results_file_it_comes_from(path):
    uncited = [block.strip()[:160] for block in claims(path) if not CITED.search(block)]
    assert not uncited, f"{path.name}: figures without their bench/results/ file:\n" + "\n---\n".join(uncited)


@pytest.mark.parametrize("path", PAGES, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_results_file_the_docs_cite_exists(path):
    gone = sorted(name for name in CITED.findall(path.read_text())
                  if not (ROOT / "bench" / "results" / name).exists())
    assert not gone, f"{path.name} cites results that are not in bench/results/: {gone}"


def test_the_check_tells_a_cited_figure_from_an_uncited_one():
    cited = "obstore spends 305 us a sample (`bench/results/perf-2026-11-28.md`)."
    assert claims_of(cited) == [True]
    assert claims_of("obstore spends a fraction of the client CPU per request.") == [False]
    assert claims_of("Reading 2 x 3.5 MB per row group; `Limits(memory=)` bounds it.") == []


def claims_of(text: str) -> list[bool]:
    return [bool(CITED.search(block)) for block in blocks(text) if FIGURE.search(block)]
