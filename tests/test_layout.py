"""The shape of the project that no linter checks: app/'s loose modules, the README as a front
page, and documentation links that lead somewhere. (The import graph has its own contracts:
pyproject.toml's import-linter section, run by scripts/test.)"""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import ROOT

CORE_LOOSE = {"__init__", "__main__", "main", "windows", "errors", "metrics"}
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_app_has_at_most_two_loose_modules_beyond_its_core_ones() -> None:
    loose = {p.stem for p in (ROOT / "app").glob("*.py")} - CORE_LOOSE
    assert len(loose) <= 2, sorted(loose)


def test_the_readme_is_a_front_page_with_the_two_commands_at_the_top() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, len(lines)
    top = "\n".join(lines[:20])
    assert "scripts/serve" in top and "scripts/test" in top


def test_every_doc_is_reachable_from_the_readme() -> None:
    linked = {m.split("#")[0] for m in LINK.findall((ROOT / "README.md").read_text())}
    docs = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")} | {"loadtest/README.md"}
    assert docs <= linked, sorted(docs - linked)


def slugs(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in markdown.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def test_documentation_links_lead_to_files_and_headings_that_exist() -> None:
    pages = [ROOT / "README.md", ROOT / "loadtest" / "README.md", *(ROOT / "docs").glob("*.md")]
    broken = []
    for page in pages:
        for target in LINK.findall(page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            missing_anchor = bool(anchor) and dest.suffix == ".md" and dest.exists() and \
                anchor not in slugs(dest.read_text())
            if not dest.exists() or missing_anchor:
                broken.append((page.name, target))
    assert not broken, broken


def test_the_bench_writes_its_table_into_the_loadtest_readme(tmp_path: Path) -> None:
    """``python -m loadtest.bench --readme loadtest/README.md`` replaces the Performance block;
    the front page holds no generated block."""
    from loadtest.lib.report import replace_readme

    readme = tmp_path / "README.md"
    readme.write_text((ROOT / "loadtest" / "README.md").read_text())
    assert replace_readme(readme, "GENERATED TABLE\n")
    text = readme.read_text()
    assert text.index("## Performance") < text.index("GENERATED TABLE") < text.index("## Accuracy")
    assert "bench:start" not in (ROOT / "README.md").read_text()


MAX_LINES = 400
# Files over the limit while they are being shrunk, each with who and why (none today).
OVER_LIMIT: set[str] = set()


def test_no_app_module_exceeds_400_lines() -> None:
    """Files of at most 400 lines in app/ (issue 48 item 4): a module a reader can hold."""
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines())
             for p in (ROOT / "app").rglob("*.py")}
    over = {name: n for name, n in sizes.items() if n > MAX_LINES and name not in OVER_LIMIT}
    assert not over, over
    assert set(sizes) >= OVER_LIMIT, sorted(OVER_LIMIT - set(sizes))  # no stale exception
