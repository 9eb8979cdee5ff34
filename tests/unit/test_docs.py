"""The README stays a short front page and every relative link in it and in docs/ resolves."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README_MAX_LINES = 200
"""A user reads the README in ten minutes; the reference lives in docs/."""
LINE_MAX = 160
"""Every line of README.md and docs/*.md: a page reads without side-scrolling (generated tables and lists included)."""
# A commit hash: 7-40 hex digits with at least one digit and one letter (so neither a number nor a word).
_COMMIT = re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")

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


def long_lines(files: list[Path], limit: int = LINE_MAX) -> list[str]:
    """'file:line: N characters' for every line longer than ``limit``."""
    return [f"{path.name}:{number}: {len(line)} characters" for path in files
            for number, line in enumerate(path.read_text().splitlines(), 1) if len(line) > limit]


def commit_hashes(text: str) -> list[tuple[int, str]]:
    """(line number, hash) of every commit hash in the prose: outside fenced code blocks, where logs may show ids."""
    found, in_fence = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            in_fence = not in_fence
            continue
        if not in_fence:
            found += [(number, h) for h in _COMMIT.findall(line)]
    return found


def test_no_line_is_longer_than_the_limit():
    assert long_lines(markdown_files()) == []


def test_the_pages_name_no_commit():
    # A page says what is true now; which commit measured a figure is in its results file, run logs in docs/records/.
    found = {p.relative_to(REPO).as_posix(): hashes for p in markdown_files() if (hashes := commit_hashes(p.read_text()))}
    assert found == {}, f"commit hashes in the docs' prose: {found}"


def test_the_line_and_hash_checks_find_what_they_look_for(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("short\n" + "x" * 161 + "\n" + "y" * 160 + "\n")
    assert long_lines([page]) == ["p.md:2: 161 characters"]
    text = "at `a55b9c5` and 4cf826c0\n```\nnode e696d651 in a log\n```\n1000000 decade facade 2.5e-6 deadbeef\n"
    assert commit_hashes(text) == [(1, "a55b9c5"), (1, "4cf826c0")]


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
