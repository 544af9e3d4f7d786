"""``/docs``: Swagger UI served from the service itself, under a policy as strict as the page's.

FastAPI's own ``/docs`` loads Swagger UI from a public CDN (a floating major version, no
integrity hash), on the same origin where the page keeps the user's key in ``sessionStorage``;
and where the service has no internet (air-gapped deployments) it is a blank page. Here the
assets come from the ``fastapi-offline`` wheel (a pinned Swagger UI release, a dependency in
pyproject.toml), the start-up script from app/web/docs.js, and the Content-Security-Policy lets
the page load and call nothing but this service. ReDoc (another CDN page) is not served.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, HTMLResponse

from app.errors import NotFound
from app.web import DOCS_ASSETS, WEB_DIR

router = APIRouter(include_in_schema=False)
# fastapi-offline's wheel is used for its files only: a pinned Swagger UI 5 (OpenAPI 3.1, which
# FastAPI writes; swagger-ui-bundle's 4.15 cannot read it), no CDN at run time.
SWAGGER_DIR = Path(str(files("fastapi_offline") / "static"))
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>batchscribe API</title>
<link rel="stylesheet" href="/docs/assets/swagger-ui.css">
<link rel="icon" type="image/png" href="/docs/assets/favicon.png">
</head>
<body>
<div id="swagger-ui"></div>
<script src="/docs/assets/swagger-ui-bundle.js"></script>
<script src="/docs/assets/docs.js"></script>
</body>
</html>
"""


@router.get("/docs")
async def docs() -> HTMLResponse:
    return HTMLResponse(PAGE, headers={**HEADERS, "Cache-Control": "no-cache"})


@router.get("/docs/assets/{name}")
async def docs_asset(name: str) -> FileResponse:
    media = DOCS_ASSETS.get(name)
    if media is None:
        raise NotFound(f"no docs asset {name!r}")
    folder = WEB_DIR if name == "docs.js" else SWAGGER_DIR
    return FileResponse(folder / name, media_type=media, headers=HEADERS)
