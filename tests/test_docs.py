"""The documentation: the site builds strictly, the reference covers every public name, and the
README stays a page a new user finishes. (Its code blocks and the guides' run in
``integration/test_docs_examples.py``.)"""

from __future__ import annotations

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
