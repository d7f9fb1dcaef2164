"""The README and docs link to each other and to the repository's files (the README is the manual;
the details moved to docs/ and benchmarks/RESULTS.md): every relative link, and every #anchor into
a markdown file, must resolve, so a moved file or a renamed heading is caught here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "RESULTS.md", *sorted((ROOT / "docs").glob("*.md"))]


def heading_anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but - and _ dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """Every heading anchor of a markdown text (a repeated heading gets -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"^#{1,6}\s+(.*)$", without_fences(markdown), flags=re.M):
        anchor = heading_anchor(heading)
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        found.add(anchor if count == 0 else f"{anchor}-{count}")
    return found


def without_fences(markdown: str) -> str:
    """The text outside fenced code blocks (where a `# comment` is no heading)."""
    return re.sub(r"^```.*?^```", "", markdown, flags=re.M | re.S)


def without_code(markdown: str) -> str:
    """The text outside code blocks and inline code, where a `[x](y)` is no link."""
    return re.sub(r"`[^`\n]*`", "", without_fences(markdown))


def broken_links(path: Path) -> list[str]:
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", without_code(path.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http(s)://, mailto: ...
            continue
        file, _, fragment = target.partition("#")
        destination = (path.parent / file).resolve() if file else path
        if not destination.exists():
            broken.append(f"{target} (no such file)")
        elif fragment and destination.suffix == ".md" and fragment not in anchors(destination.read_text()):
            broken.append(f"{target} (no such heading)")
    return broken


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    assert broken_links(path) == [], f"{path.relative_to(ROOT)} has broken links"


def test_a_broken_link_or_anchor_is_found(tmp_path):
    (tmp_path / "other.md").write_text("# A heading, with `code --x`\n\n## Twice\n\n## Twice\n```\n# no heading\n```\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#a-heading-with-code---x) [ok](other.md#twice-1) [no](other.md#no-heading) [ok](#top) `[code](gone.md)`\n"
        "# Top\n[gone](gone.md) [bad anchor](other.md#twice-2) [web](https://example.com/x)\n"
    )
    assert broken_links(page) == [
        "other.md#no-heading (no such heading)",
        "gone.md (no such file)",
        "other.md#twice-2 (no such heading)",
    ]


def test_the_readme_links_to_what_moved_out_of_it():
    readme = (ROOT / "README.md").read_text()
    for moved in ("docs/quickstart.md", "docs/building.md", "docs/training.md", "docs/development.md",
                  "benchmarks/RESULTS.md#the-recipe-measured", "benchmarks/RESULTS.md#objectives-aimed-at-acceptance"):
        assert f"]({moved}" in readme, moved
