"""The page at ``/``: static HTML, JavaScript and CSS served as they are (no build step, nothing
from a CDN: the page works on a closed network). Routes in :mod:`app.api.web`; /docs (Swagger
UI, packaged) in :mod:`app.api.docs`."""

from __future__ import annotations

from pathlib import Path

WEB_DIR = Path(__file__).parent
ASSETS: dict[str, str] = {  # what /web/<name> serves; nothing else in this folder is reachable
    "app.js": "text/javascript; charset=utf-8",
    "live.js": "text/javascript; charset=utf-8",
    "mic-worklet.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
# /docs/assets/<name>: Swagger UI from the fastapi-offline wheel, and docs.js from here.
DOCS_ASSETS: dict[str, str] = {
    "swagger-ui-bundle.js": "text/javascript; charset=utf-8",
    "swagger-ui.css": "text/css; charset=utf-8",
    "favicon.png": "image/png",
    "docs.js": "text/javascript; charset=utf-8",
}
# Public like /docs (they hold no data); every API call the page makes carries the user's key.
PAGE_PATHS = frozenset({"/", *(f"/web/{name}" for name in ASSETS),
                        *(f"/docs/assets/{name}" for name in DOCS_ASSETS)})
