"""README.md and the pages under docs/: the README stays short and in its order, links resolve, nothing
points outside the repository.

- README.md has at most README_MAX_LINES lines and the sections of README_SECTIONS, in that order, as
  `## ` headings.
- Every relative Markdown link of README.md and docs/*.md names a file or folder that exists in the
  repository (the `#anchor` part is not checked); links into code spans and code blocks are ignored.
- No page names a file outside the repository: no link resolves above the repository root, and no page
  mentions OUTSIDE_NAMES.
- The CPU roofline peaks are stated on one docs page only; the others link there.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
README_MAX_LINES = 200
README_SECTIONS = (
    "What it is",
    "Status",
    "Quick start",
    "Options",
    "Guarantees and refusals",
    "Calibration",
    "Metrics",
    "Deployment",
    "Limitations",
    "Development",
)
OUTSIDE_NAMES = ("DESIGN.md", "../shared", "/work/shared")
"""Files that are not part of the repository; a page that names them sends its reader nowhere."""
CPU_PEAK_SPELLINGS = ("1e11", "2e10", "100 GFLOP/s", "20 GB/s")

FENCED_BLOCK = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def page_id(page: Path) -> str:
    return str(page.relative_to(REPO))


def relative_links(text: str) -> list[str]:
    """Targets of the Markdown links of `text` that point into the repository, outside code."""
    prose = CODE_SPAN.sub("", FENCED_BLOCK.sub("", text))
    targets = (match.group(1) for match in LINK.finditer(prose))
    return [target for target in targets if not EXTERNAL.match(target) and not target.startswith("#")]


def test_relative_links_tiny_case() -> None:
    text = (
        "See [a](docs/a.md#part), [web](https://x.org/y), [anchor](#here),\n"
        '`[code](not/a/link.md)`, ![img](pic.png "title").\n```\n[fenced](nope.md)\n```\n'
    )
    assert relative_links(text) == ["docs/a.md#part", "pic.png"]


def test_readme_is_short() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines, at most {README_MAX_LINES}"


def test_readme_sections_in_order() -> None:
    headings = [
        line[3:].strip() for line in README.read_text(encoding="utf-8").splitlines() if line.startswith("## ")
    ]
    missing = [section for section in README_SECTIONS if section not in headings]
    assert not missing, f"README.md lacks the sections {missing}; its sections: {headings}"
    order = [headings.index(section) for section in README_SECTIONS]
    assert order == sorted(order), f"README.md sections out of order: {headings}"


@pytest.mark.parametrize("page", pages(), ids=page_id)
def test_relative_links_resolve_inside_repository(page: Path) -> None:
    broken = []
    for target in relative_links(page.read_text(encoding="utf-8")):
        path = (page.parent / target.split("#", 1)[0]).resolve()
        if not path.is_relative_to(REPO):
            broken.append(f"{target} (outside the repository)")
        elif not path.exists():
            broken.append(f"{target} (no such file)")
    assert not broken, f"{page_id(page)}: {broken}"


@pytest.mark.parametrize("page", pages(), ids=page_id)
def test_no_page_names_files_outside_repository(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    named = [name for name in OUTSIDE_NAMES if name in text]
    assert not named, f"{page_id(page)} names files outside the repository: {named}"


def test_cpu_peaks_stated_on_one_docs_page() -> None:
    stating = [
        page_id(page)
        for page in pages()
        if any(spelling in page.read_text(encoding="utf-8") for spelling in CPU_PEAK_SPELLINGS)
    ]
    assert len(stating) <= 1, f"the CPU roofline peaks are stated on {stating}; state them once and link"
