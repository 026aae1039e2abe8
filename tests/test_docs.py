"""The documentation: the site builds strictly, the reference covers every public name, and the
README stays a page a new user finishes. (Its code blocks and the guides' run in
``integration/test_docs_examples.py``.)"""

from __future__ import annotations

import html
import re
import subprocess
import sys
from pathlib import Path

import yaml

import loader

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 300


def test_the_site_builds_strictly(tmp_path):
    """``mkdocs build --strict``: a broken link, anchor or API reference fails it."""
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                           "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "reference" / "datasets" / "index.html").is_file()
    # The options reference shows each group's fields with their types and defaults.
    page = html.unescape(re.sub(r"<[^>]+>", "", (tmp_path / "site" / "reference" / "options" / "index.html")
                                .read_text(encoding="utf-8")))
    page = re.sub(r"\s+", " ", page)
    for fields in ("Limits( *, concurrency: int | None = None, memory: int | None = None, ordered: bool = True, )",
                   "Split( *, rank: int | None = None,", "Store( *, backend: str | StoreFactory | None = None,",
                   "Cache( dir: str | PathLike[str], limit: int | None = None, validate: str = 'listing', )",
                   "Reading( *, shuffle_buffer: int | None = None, part_size: int | None = None,"):
        assert fields.replace("'", '"') in page, fields
    assert "(None: 10 GiB;" in page and "32 MiB for Parquet" in page


def test_the_defaults_the_reference_states_are_the_code_s():
    """The docstrings state defaults in words; these are the numbers behind them."""
    from loader.cache.options import DEFAULT_CACHE_LIMIT, DEFAULT_VALIDATE
    from loader.datasets.options import DEFAULT_UNIT_BYTES
    from loader.formats.shards import DEFAULT_PART_SIZE

    assert DEFAULT_CACHE_LIMIT == 10 << 30 and loader.Cache("d").validate == DEFAULT_VALIDATE
    assert DEFAULT_UNIT_BYTES == 32 << 20 and DEFAULT_PART_SIZE == 16 << 20


def documented_names() -> set[str]:
    """What the reference pages render: every ``::: loader.NAME`` line."""
    return {match for page in (DOCS / "reference").glob("*.md")
            for match in re.findall(r"^::: (loader\.[\w.]+)\s*$", page.read_text(encoding="utf-8"), re.M)}


def test_the_api_reference_covers_every_public_name():
    """Each name of ``loader.__all__`` (and what users' tests import from ``loader.testing``) has an entry,
    by its public name, so moving a module never moves the reference."""
    expected = {f"loader.{name}" for name in loader.__all__} | {"loader.testing.DevServer",
                                                                "loader.testing.MemoryStore"}
    assert documented_names() == expected


def test_the_guides_and_the_reference_are_in_the_navigation():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))

    def pages(entries) -> set[str]:
        found: set[str] = set()
        for entry in entries:
            for value in (entry.values() if isinstance(entry, dict) else [entry]):
                found |= pages(value) if isinstance(value, list) else {value}
        return found

    listed = pages(config["nav"])
    on_disk = {p.relative_to(DOCS).as_posix() for folder in ("guides", "reference", "design")
               for p in (DOCS / folder).glob("*.md")} | {"index.md"}
    assert on_disk <= listed, f"pages missing from mkdocs.yml's nav: {sorted(on_disk - listed)}"


def test_the_readme_is_short_and_starts_with_the_two_commands():
    text = README.read_text(encoding="utf-8")
    lines = text.count("\n")
    print(f"README.md: {lines} lines (at most {README_MAX_LINES})")
    assert lines <= README_MAX_LINES
    first_block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert first_block is not None and text.index("```") == first_block.start()
    commands = [line.split("#")[0].strip() for line in first_block.group(1).splitlines()]
    assert commands == ["make demo", "make test"]


def test_the_readmes_links_lead_somewhere():
    """The README lives outside the site, so mkdocs cannot check its links: every relative one
    names a file or folder of the repository."""
    text = README.read_text(encoding="utf-8")
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in t]
    missing = [t for t in targets if t and not (ROOT / t).exists()]
    assert targets and missing == []


def test_no_page_tells_users_to_install_a_name_that_is_not_ours():
    """PyPI's ``loader`` is someone else's package."""
    for page in [README, *DOCS.rglob("*.md")]:
        text = page.read_text(encoding="utf-8")
        bad = re.findall(r"pip install +['\"]?loader\b(?![-\w])", text)
        assert bad == [], f"{page.relative_to(ROOT)}: {bad}"


def test_no_page_a_user_reads_teaches_a_deprecated_spelling():
    """The README, the first page, the guides and the reference show the current spellings; the
    old ones appear only in the reference's table of earlier spellings. (Checkpoints have a
    ``parts_inflight=`` of their own, which is current.)"""
    from loader.datasets.groups import DEPRECATED

    current = {"retry", "listing", "ordered", "rank", "world_size", "index", "part_size", "chunk_size",
               "shuffle_buffer", "samples_per_epoch", "uneven_ranks"}  # fields of the new groups too
    old = sorted({name for spellings in DEPRECATED.values() for name in spellings} - current)
    pattern = re.compile(r"\b(" + "|".join(old) + r")\b(?!\()")
    pages = [README, DOCS / "index.md", *sorted((DOCS / "guides").glob("*.md")),
             *sorted((DOCS / "reference").glob("*.md"))]
    found = []
    for page in pages:
        text = page.read_text(encoding="utf-8")
        if page.name == "options.md":
            text = text.split("## Spellings of earlier releases")[0]
        if page.name == "checkpoints.md":
            text = text.replace("parts_inflight", "")
        found += [f"{page.relative_to(ROOT)}: {match.group(0)}" for match in pattern.finditer(text)]
    assert found == []


def test_the_hints_speak_the_current_spellings():
    """What the library advises (ls, the stats report) names the current options."""
    from loader.datasets.stats import report
    from loader.s3 import ObjectInfo
    from loader.tools.ls import summarize_listing

    small = [ObjectInfo(f"t/{i:04d}.jpg", 3000) for i in range(10)]
    stats = {"samples": 1000, "seconds": 10.0, "workers": 2, "requests": 1000, "get_s": 30.0,
             "latency_p50_s": 0.02, "latency_p99_s": 0.05, "peak_inflight": 64, "steps": 100,
             "data_wait_s": 5.0, "step_s": 5.0, "data_wait_fraction": 0.5, "first_batch_s": 0.5,
             "step_wait_p50_s": 0.04, "step_wait_p95_s": 0.08, "step_wait_p99_s": 0.1,
             "consumer_wait_s": 15.0, "transform_s": 1.0, "handoff_s": 1.0}
    for text in ("\n".join(summarize_listing("s3://b/t/", small)), report(stats, inflight_limit=64)):
        assert "Limits(concurrency=)" in text and "max_inflight" not in text and "shards_inflight" not in text
