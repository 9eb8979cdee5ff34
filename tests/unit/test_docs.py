"""The README stays a short front page and every relative link in it and in docs/ resolves."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README_MAX_LINES = 320
"""A user reads the README in ten minutes; the reference lives in docs/."""

PENDING_PAGES: set[str] = set()
"""Pages other branches are writing (the README already links them). Allowed to be missing until
they land; the lead removes each name here when its page is merged."""

# [text](target) and ![alt](target); the target ends at whitespace or ')' (an optional "title" follows).
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^\s*(```|~~~)")


def markdown_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def relative_links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every link to a local path, outside fenced code blocks; URLs,
    mail addresses and in-page anchors are not local paths."""
    links, in_fence = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        for target in _LINK.findall(line):
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
                continue
            links.append((number, target))
    return links


def broken_links(files: list[Path], root: Path = REPO, allowed_missing: frozenset[str] = frozenset()) -> list[str]:
    """'file:line: target' for every relative link whose file does not exist (resolved against the
    linking file's directory, the '#anchor' dropped), unless it is one of ``allowed_missing``
    (paths relative to ``root``)."""
    broken = []
    for path in files:
        for number, target in relative_links(path.read_text()):
            resolved = (path.parent / target.split("#", 1)[0]).resolve()
            try:
                name = resolved.relative_to(root.resolve()).as_posix()
            except ValueError:
                name = str(resolved)
            if not resolved.exists() and name not in allowed_missing:
                broken.append(f"{path.relative_to(root)}:{number}: {target}")
    return broken


def test_readme_is_short():
    lines = len((REPO / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move reference to docs/"


def test_every_relative_link_resolves():
    assert broken_links(markdown_files(), allowed_missing=frozenset(PENDING_PAGES)) == []


def test_readme_links_every_docs_page():
    readme_targets = {(REPO / target.split("#", 1)[0]).resolve() for _, target in relative_links((REPO / "README.md").read_text())}
    unlinked = [p.name for p in sorted((REPO / "docs").glob("*.md")) if p.resolve() not in readme_targets]
    assert unlinked == [], f"docs pages the README does not link: {unlinked}"


def test_pending_pages_have_not_landed():
    # Once a pending page exists the allowance is stale: remove its name from PENDING_PAGES.
    landed = sorted(name for name in PENDING_PAGES if (REPO / name).exists())
    assert landed == [], f"these pages exist now; drop them from PENDING_PAGES: {landed}"


def test_the_link_check_finds_broken_links(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "real.md").write_text("# real\n")
    page = tmp_path / "README.md"
    page.write_text("\n".join([
        "[ok](docs/real.md) [ok with anchor](docs/real.md#real) [url](https://example.com) [anchor](#top)",
        "[gone](docs/gone.md)",
        "![picture](docs/img/missing.png)",
        "```",
        "[not a link inside a code block](docs/nowhere.md)",
        "```",
        "[pending](docs/pending.md)",
    ]))
    nested = tmp_path / "docs" / "nested.md"
    nested.write_text("[up](../README.md) [sibling](real.md) [wrong dir](docs/real.md)\n")
    found = broken_links([page, nested], root=tmp_path, allowed_missing=frozenset({"docs/pending.md"}))
    assert found == ["README.md:2: docs/gone.md", "README.md:3: docs/img/missing.png", "docs/nested.md:1: docs/real.md"]
