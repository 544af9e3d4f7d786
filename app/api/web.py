"""The page at ``/`` and its two assets (app/web): served as files, with a strict policy.

The Content-Security-Policy lets the page load only its own script and style and talk only to
this service: no inline script, no third-party origin, no framing. Transcript text is put in
the page as text, never as markup (app.js uses ``textContent``), so an upload cannot inject any.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import FileResponse

from app.errors import NotFound
from app.web import ASSETS, WEB_DIR

router = APIRouter(include_in_schema=False)
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "connect-src 'self'; img-src 'self' data: blob:; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # a new version of the page is picked up at once
}


@router.get("/")
async def page() -> FileResponse:
    return FileResponse(WEB_DIR / "index.html", media_type="text/html; charset=utf-8",
                        headers=HEADERS)


@router.get("/web/{name}")
async def asset(name: str) -> FileResponse:
    if name not in ASSETS:
        raise NotFound(f"no page asset {name!r}")
    return FileResponse(WEB_DIR / name, media_type=ASSETS[name], headers=HEADERS)
