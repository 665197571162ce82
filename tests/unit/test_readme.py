"""README.md stays scannable, and the links of README.md and docs/ resolve."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_CELL_WORDS = 40

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_CELL_SPLIT = re.compile(r"(?<!\\)\|")
_SEPARATOR = re.compile(r"^\s*:?-+:?\s*$")


def _prose_lines(path):
    """The lines of a markdown file outside fenced code blocks."""
    inside = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            inside = not inside
            continue
        if not inside:
            yield line


def _table_cells(path):
    """(row, cell text) of every cell of every pipe table, separator rows left out."""
    for line in _prose_lines(path):
        stripped = line.strip()
        if not stripped.startswith("|"):
            continue
        cells = _CELL_SPLIT.split(stripped.strip("|"))
        if all(_SEPARATOR.match(cell) for cell in cells):
            continue
        for cell in cells:
            yield stripped, cell.strip()


def _links(path):
    for line in _prose_lines(path):
        yield from _LINK.findall(_CODE_SPAN.sub("", line))


def _relative_targets(path):
    """Relative link targets of a markdown file, anchors dropped."""
    for target in _links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # http:, https:, mailto: ...; anchors in the same page
        yield target, target.split("#", 1)[0]


def _markdown_files():
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def test_cell_parser():
    sample = "| `a` | one two \\| three |"
    cells = _CELL_SPLIT.split(sample.strip().strip("|"))
    assert [c.strip() for c in cells] == ["`a`", "one two \\| three"]


def test_readme_has_tables():
    assert list(_table_cells(README))


def test_no_readme_table_cell_over_limit():
    long_cells = [
        (len(cell.split()), cell[:80])
        for _, cell in _table_cells(README)
        if len(cell.split()) > MAX_CELL_WORDS
    ]
    assert not long_cells, f"README table cells over {MAX_CELL_WORDS} words: {long_cells}"


def test_first_section_is_quick_start():
    sections = [line for line in _prose_lines(README) if line.startswith("## ")]
    assert sections, "README.md has no `## ` section"
    assert sections[0].strip().lower() == "## quick start"


def test_quick_start_keeps_its_commands():
    text = README.read_text(encoding="utf-8")
    quick_start = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert re.search(r"^make demo\b", quick_start, re.MULTILINE)
    assert re.search(r"^make test\b", quick_start, re.MULTILINE)


def test_readme_links_every_mode_page_and_each_exists():
    linked = {
        target for _, target in _relative_targets(README) if target.startswith("docs/modes/")
    }
    assert linked, "README.md links no docs/modes page"
    for target in sorted(linked):
        assert (ROOT / target).is_file(), f"README.md links missing {target}"
    pages = {f"docs/modes/{p.name}" for p in (ROOT / "docs" / "modes").glob("*.md")}
    assert pages <= linked, f"mode pages README.md does not link: {sorted(pages - linked)}"


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    missing = [
        target
        for target, file_part in _relative_targets(path)
        if file_part and not (path.parent / file_part).exists()
    ]
    assert not missing, f"{path.relative_to(ROOT)} links missing files: {missing}"
