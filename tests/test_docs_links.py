"""The README and docs/ keep their relative links valid, and docs/design.md indexes every Note.

A relative link must name a file or folder of the checkout; a link with an anchor into a markdown
file must name one of that file's headings (as GitHub makes them: lower case, punctuation but
hyphens and underscores dropped, spaces as hyphens). Links with a scheme (https:, mailto:) are
not checked.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# [text](target) outside code: the target up to whitespace or the closing parenthesis.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*```")


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code spans, whose brackets are not links."""
    kept, in_code = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            in_code = not in_code
            continue
        if not in_code:
            kept.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(kept)


def _anchors(page: Path) -> set[str]:
    anchors, seen = set(), {}
    for line in _prose(page.read_text()).splitlines():
        heading = re.match(r"#{1,6}\s+(.*)", line)
        if heading is None:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _relative_links(page: Path) -> list[str]:
    return [t for t in LINK.findall(_prose(page.read_text())) if not re.match(r"\w+:", t)]


def test_there_are_pages_and_links_to_check():
    assert (ROOT / "docs" / "design.md") in PAGES
    assert len(_relative_links(ROOT / "README.md")) >= 8


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_to_an_existing_file(page):
    broken = []
    for target in _relative_links(page):
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no such file {resolved.relative_to(ROOT)}")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{target}: no heading #{anchor} in {resolved.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_design_md_indexes_every_note_the_code_defines():
    # A Note is defined where its title stands alone on a comment line, underlined with ~~~.
    defined = {}
    for folder in ("csrc", "gossip_ext", "tests"):
        for source in (ROOT / folder).rglob("*"):
            if source.suffix not in {".h", ".cpp", ".cu", ".cuh", ".inc", ".py"}:
                continue
            lines = source.read_text(errors="replace").splitlines()
            for line, below in zip(lines, lines[1:]):
                title = re.fullmatch(r"\s*(?://|#)\s*(Note \[[^\]]+\])\s*", line)
                if title and re.fullmatch(r"\s*(?://|#)\s*~{3,}\s*", below):
                    defined[title.group(1)] = source.relative_to(ROOT)
    assert defined, "no Note found: the pattern no longer matches the code"
    design = (ROOT / "docs" / "design.md").read_text()
    missing = [f"{note} ({where})" for note, where in defined.items() if note not in design]
    assert not missing, "docs/design.md section 5 lacks: " + ", ".join(missing)
