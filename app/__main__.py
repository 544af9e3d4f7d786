"""``python -m app``: run the service on its settings (environment variables or flags, ``--help``:
app/config/cli.py, docs/configuration.md)."""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Sequence
from types import FrameType
from typing import Any, Protocol

# Before torch or CTranslate2 load: idle OpenMP threads sleep instead of spinning, so torch's
# pool (mel, pyannote VAD) and CTranslate2's do not starve each other on a few cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from app.engine.device import use_pci_bus_order  # light: os and logging only

use_pci_bus_order()  # before CUDA initialises: CUDA ordinal k is NVML's GPU k

import uvicorn  # noqa: E402
from uvicorn.protocols.websockets.websockets_sansio_impl import (  # noqa: E402
    WebSocketsSansIOProtocol,
)

from app.api.middleware.keys import exposure_problem, is_loopback  # noqa: E402
from app.config import Settings, cli  # noqa: E402
from app.engine.loading import REFUSALS, preflight  # noqa: E402
from app.main import create_app, setup_logging  # noqa: E402


class ServedApp(Protocol):
    """What the server needs of the app (app/main.py's): its state, where the lifespan puts
    ``begin_shutdown``. FastAPI stays inside app/api and app/main.py (pyproject.toml)."""

    state: Any


class GracefulServer(uvicorn.Server):
    """uvicorn, plus: a SIGTERM starts the app's drain at once.

    uvicorn alone stops listening, waits for open requests, and only then runs the lifespan
    shutdown; meanwhile the runner would keep starting new batches, and an open ``?wait=true``
    request would hold the drain up to its sync time-out. Draining from the signal keeps the whole
    exit within ``shutdown_grace_s`` (what Kubernetes' terminationGracePeriodSeconds expects).
    """

    def __init__(self, config: uvicorn.Config, app: ServedApp) -> None:
        super().__init__(config)
        self.app = app

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        begin = getattr(self.app.state, "begin_shutdown", None)
        if begin is not None:  # None while the model is still loading: nothing to drain
            begin()


class WebSockets(WebSocketsSansIOProtocol):
    """uvicorn's default WebSocket protocol, whose denial response (a handshake refused 401 or
    403 by the key and origin middleware) counts as a finished handshake. uvicorn 0.54 writes the
    denial but logs ERROR "ASGI callable returned without completing handshake." for each one
    (Kludex/uvicorn#3138, open), so any client could fill an error alert. Its wsproto protocol
    has no such log, but at 16 live streams on 2 cores it read turn p50 0.65-0.72 s against
    0.63 s (pure-Python framing on the event loop)."""

    async def send(self, message: Any) -> None:
        await super().send(message)
        if message["type"] == "websocket.http.response.body" and not message.get("more_body"):
            self.handshake_complete = True


def main(argv: Sequence[str] | None = None) -> int:
    try:  # a typo in a variable or flag, a value out of bounds: one line naming it, exit 2
        settings = cli.read(sys.argv[1:] if argv is None else argv)
    except cli.BadFlags as exc:
        print(f"batchscribe: cannot start: {exc}", file=sys.stderr)
        return 2
    if problem := exposure_problem(settings):  # before anything loads: fail in a second
        print(problem, file=sys.stderr)
        return 2
    if "libtcmalloc" not in os.environ.get("LD_PRELOAD", ""):
        print("warning: tcmalloc is not preloaded; CPU batching runs ~2x slower with glibc "
              "malloc (see README)", file=sys.stderr)
    try:  # a GPU asked for but absent, a missing model...: one line, no traceback, exit 2
        preflight(settings)
    except REFUSALS as exc:
        print(f"batchscribe: cannot start: {exc}", file=sys.stderr)
        return 2
    setup_logging(settings.log_level)
    if settings.security.allow_anonymous and not settings.security.api_key_sha256 \
            and not is_loopback(settings.host):
        logging.getLogger("batchscribe").warning(
            "serving without API keys on %s (BATCHSCRIBE_SECURITY__ALLOW_ANONYMOUS=true): every "
            "client can read and cancel every job", settings.host)
    app = create_app(settings)
    GracefulServer(server_config(app, settings), app).run()
    return 0


def server_config(app: Any, settings: Settings, **overrides: Any) -> uvicorn.Config:
    """uvicorn as the service runs it; the in-process test servers and the feed benches serve
    the app through this too, so they meet the same protocol and limits (``overrides``: their
    port, log level, lifespan)."""
    kw: dict[str, Any] = {
        "host": settings.host, "port": settings.port, "log_config": None,
        # Open requests get the grace plus a second: the drain (same grace) answers the last
        # ?wait=true requests at its end. Never None: 0 must not mean "wait forever".
        "timeout_graceful_shutdown": math.ceil(settings.shutdown_grace_s) + 1,
        "timeout_keep_alive": settings.keep_alive_s,  # (uvicorn's default of 5 s raced clients)
        "ws": WebSockets,
        "ws_per_message_deflate": settings.live.per_message_deflate,
    }
    return uvicorn.Config(app, **{**kw, **overrides})


if __name__ == "__main__":
    raise SystemExit(main())
