"""The documentation holds together: README.md stays a five-minute read, every relative link in the docs reaches a
file (and a heading, when it names one), every page under docs/ is linked from the README, and every repository
path the pages quote in backticks exists. Pure file reads; run by `make test` with the rest of the suite."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_LIMIT_BYTES = 12_000  # issue 25: the README is the pitch, the two commands and links; reference goes to docs/
PAGES = sorted(
    [
        ROOT / "README.md",
        ROOT / "SECURITY.md",
        ROOT / "bench" / "README.md",
        ROOT / "bench" / "HISTORY.md",
        ROOT / "e2e" / "README.md",
        *(ROOT / "docs").glob("*.md"),
    ]
)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
# Folders whose files the pages quote by path; a quoted path under one of them must exist.
QUOTED_ROOTS = (
    "bench/",
    "charts/",
    "crds/",
    "dashboards/",
    "docs/",
    "e2e/",
    "examples/",
    "operator/",
    "tests/",
    "workers/",
)


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks (a `# comment` in a shell block is not a heading, nor a link)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    for line in prose_lines(page.read_text()):
        m = HEADING.match(line)
        if m:
            base, n = slug(m.group(1)), 0
            while (f"{base}-{n}" if n else base) in found:  # GitHub numbers repeated headings
                n += 1
            found.add(f"{base}-{n}" if n else base)
    return found


def relative_links(page: Path) -> list[str]:
    return [
        target
        for line in prose_lines(page.read_text())
        for target in LINK.findall(line)
        if not re.match(r"^[a-z][a-z0-9+.-]*:", target)
    ]  # http:, https:, mailto: are not checked here


def test_readme_is_under_its_size_limit():
    size = len((ROOT / "README.md").read_bytes())
    assert size < README_LIMIT_BYTES, f"README.md is {size} bytes (limit {README_LIMIT_BYTES}): move reference to docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_reaches_a_file_and_heading(page):
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}:\n" + "\n".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_code_fences_are_closed(page):
    """An unclosed fence turns the rest of the page into code, headings and links included."""
    fences = [n for n, line in enumerate(page.read_text().splitlines(), 1) if FENCE.match(line)]
    assert len(fences) % 2 == 0, f"{page.relative_to(ROOT)}: odd number of code fences, the last at line {fences[-1]}"


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in relative_links(ROOT / "README.md")}
    missing = [p.name for p in (ROOT / "docs").glob("*.md") if p.resolve() not in linked]
    assert not missing, f"docs pages the README does not link: {missing}"


@pytest.mark.parametrize("page", [p for p in PAGES if p.name != "HISTORY.md"], ids=lambda p: str(p.relative_to(ROOT)))
def test_quoted_repository_paths_exist(page):
    """`tests/kube/test_ha.py` in a page must still be there after a move (HISTORY.md quotes paths as they were)."""
    stale = []
    for line in prose_lines(page.read_text()):
        for span in CODE_SPAN.findall(line):
            path = span.split()[0] if span.split() else ""
            if not path.startswith(QUOTED_ROOTS) or re.search(r"[*<>{}$]", path):
                continue
            path = path.rstrip(".,:;)")
            if not (ROOT / path).exists():
                stale.append(path)
    assert not stale, f"{page.relative_to(ROOT)} quotes paths that do not exist: {sorted(set(stale))}"
