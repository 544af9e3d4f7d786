"""Issue 38 item 6: /docs works offline and loads nothing from a third party.

Swagger UI's assets come from the service (the fastapi-offline wheel, Swagger UI 5) under a strict
Content-Security-Policy. In real Chromium (Debian's, as in tests/test_web.py), with every
request outside the service's origin recorded and blocked: the operations list is visible, no
request leaves the origin, and the policy blocks nothing the page needs.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from tests.helpers import fake_service, sha
from tests.test_web import ARGS, CHROMIUM, missing


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    key = sha("docs-key")  # with keys: /docs and its assets stay public
    with fake_service(tmp_path_factory.mktemp("docs"), security={"api_key_sha256": [key]}) as base:
        yield base


def test_docs_assets_are_served_here_under_a_strict_policy(url: str) -> None:
    page = httpx.get(url + "/docs")
    assert page.status_code == 200
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "default-src 'none'" in csp and "unsafe" not in csp
    assert "cdn" not in page.text.lower() and "<script>" not in page.text  # no inline script
    for asset in ("swagger-ui-bundle.js", "swagger-ui.css", "docs.js"):
        r = httpx.get(f"{url}/docs/assets/{asset}")
        assert r.status_code == 200 and len(r.content) > 100, asset
    assert httpx.get(url + "/docs/assets/index.html").status_code == 401  # only the listed files
    assert httpx.get(url + "/redoc").status_code == 401  # not served (it was another CDN page)


def test_docs_render_in_chromium_with_nothing_from_outside(url: str) -> None:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing("the playwright package is not installed (the test extra)")
    if not CHROMIUM.is_file():
        missing(f"no chromium at {CHROMIUM} (apt-get install chromium)")
    origin = urlsplit(url).netloc
    outside: list[str] = []
    problems: list[str] = []

    def route(r: Any) -> None:
        if urlsplit(r.request.url).netloc == origin or r.request.url.startswith("data:"):
            r.continue_()
        else:
            outside.append(r.request.url)
            r.abort()

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        try:
            page = browser.new_page()
            page.route("**/*", route)
            page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: problems.append(str(e)))
            page.goto(url + "/docs")
            page.wait_for_selector(".opblock", timeout=30_000)
            paths = page.locator(".opblock-summary-path").all_inner_texts()
            assert any("/transcribe" in t for t in paths), paths
            assert page.locator(".opblock").first.is_visible()
        finally:
            browser.close()
    assert outside == []
    assert not [m for m in problems if "Content Security Policy" in m or "Refused" in m], problems
