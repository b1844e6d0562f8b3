"""The docs' links resolve (files and #anchors, as GitHub renders headings), and the
benchmark page stays a reference: at most 400 lines, no tracker numbers, citing only
result files that are kept (bench/results-cited/) or a revision where older ones live."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "bench").rglob("*.md"))]


def _prose(text: str) -> list[str]:
    """The lines outside fenced code blocks (code blocks become empty lines)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            lines.append("")
        else:
            lines.append("" if fenced else line)
    return lines


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown text."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in _prose(text):
        m = HEADING.match(line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(2).strip().lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    bad = []
    for i, line in enumerate(_prose(path.read_text()), 1):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            file, _, fragment = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                bad.append(f"{path.relative_to(root)}:{i}: {target} (no such file)")
            elif fragment and dest.suffix == ".md" and fragment not in anchors(dest.read_text()):
                bad.append(f"{path.relative_to(root)}:{i}: {target} (no such heading)")
    return bad


def test_anchors_follow_githubs_rule() -> None:
    text = "# Serving: vLLM's server (`bench/x_y.py`): ok\n```\n# not a heading\n```\n## A b\n## A b\n"
    assert anchors(text) == {"serving-vllms-server-benchx_ypy-ok", "a-b", "a-b-1"}


def test_every_relative_link_in_the_docs_resolves(tmp_path: Path) -> None:
    docs = _docs()
    assert sum(len(LINK.findall(p.read_text())) for p in docs) > 100  # control: links are seen
    bad = [b for p in docs for b in broken_links(p)]
    assert bad == [], "\n".join(bad)
    # control: a missing file and a missing heading are both reported
    page = tmp_path / "page.md"
    page.write_text("# Title\n[a](page.md#title) [b](page.md#nope) [c](gone.md)\n")
    assert [b.split(": ", 1)[1] for b in broken_links(page, tmp_path)] == [
        "page.md#nope (no such heading)",
        "gone.md (no such file)",
    ]


def test_benchmarks_page_is_a_reference() -> None:
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    assert len(text.splitlines()) <= 400
    assert re.findall(r"(?<![\w/&])#\d+", text) == []  # no tracker numbers
    assert "git log -p docs/benchmarks.md" in text  # where the history is


def test_cited_results_are_few_small_and_kept() -> None:
    kept = [p for p in (ROOT / "bench" / "results-cited").rglob("*") if p.is_file()]
    assert kept and sum(p.stat().st_size for p in kept) < 300 * 1024
    assert [p.name for p in kept if p.suffix == ".log"] == []
    # a removed result is cited by the revision that holds it, never as a path of today's tree
    stale = []
    for path in _docs():
        if path.is_relative_to(ROOT / "bench" / "results-cited") and path.name != "README.md":
            continue  # the results themselves record the command that made them
        for i, line in enumerate(path.read_text().splitlines(), 1):
            for m in re.finditer(r"bench/suite/results", line):
                if not re.search(r"[0-9a-f]{7,40}[: ]$", line[: m.start()]):
                    stale.append(f"{path.relative_to(ROOT)}:{i}")
    assert stale == [], stale
