"""The bench's Markdown, rendered from its committed results: every check shown with its verdict
(a failed one marked FAIL), and the block the README carries kept short."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loadtest.bench import main, markdown

RESULTS = Path(__file__).resolve().parents[1] / "loadtest" / "results" / "bench.json"


def results() -> dict[str, Any]:
    out: dict[str, Any] = json.loads(RESULTS.read_text())
    return out


def test_every_check_is_rendered_with_its_verdict() -> None:
    res = results()
    md = markdown(res)
    fails = sum(c["ok"] is False for c in res["checks"])
    assert md.count("**FAIL**") == fails
    assert md.count(" pass") >= sum(c["ok"] is True for c in res["checks"])
    assert f"**{res['service']['load_en']['throughput_x']:.1f}x**" in md
    assert res["meta"]["machine"]["git"] in md
    assert len(md.splitlines()) <= 50  # the README's index stays an index


def test_render_rewrites_the_readme_block(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# x\n<!-- bench:start -->\nold\n<!-- bench:end -->\nafter\n")
    assert main(["--render", str(RESULTS), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert "old" not in text and text.endswith("<!-- bench:end -->\nafter\n")
    assert markdown(results()) in text
