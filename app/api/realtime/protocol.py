"""OpenAI's Realtime API as this service's socket speaks it before the core takes over: which
subprotocol to answer, which handshakes are refused with a reason (an ``error`` event, then a
close), and what ``POST /v1/realtime/client_secrets`` reads of its body. The session's own
protocol (events, ``session.update``) is app/live, run behind the door."""

from __future__ import annotations

from typing import Any

from app.api.middleware.secrets import SUBPROTOCOL_KEY
from app.errors import BadRequest

INTENTS = ("transcription",)
MAX_URL = 2048  # the jobs table's callback_url column
TTL_S = (10, 7200)  # what expires_after.seconds may ask, as on OpenAI's API


def pick_subprotocol(offered: list[str]) -> str | None:
    """The subprotocol to answer with: Chromium fails a handshake that offered some and got
    none back, so ``realtime`` (what OpenAI's browser clients offer) when offered, else any
    offered one but the key's (it would echo the secret), else that one."""
    if not offered:
        return None
    if "realtime" in offered:
        return "realtime"
    plain = [p for p in offered if not p.startswith(SUBPROTOCOL_KEY)]
    return plain[0] if plain else offered[0]


def handshake_refusal(intent: str | None, ready: bool) -> tuple[str, str, str | None] | None:
    """Why a socket is not served: (code, message, param), or None."""
    if intent not in INTENTS:
        return ("invalid_intent", f"only intent=transcription is served here, not {intent!r}",
                "intent")
    if not ready:
        return ("not_ready", "the model is not loaded yet, or the service is shutting down", None)
    return None


SIGNED_CALLBACK_ONLY = ("a socket opened with a client secret delivers only to the callback_url "
                        "the secret was minted with (POST /v1/realtime/client_secrets with "
                        "callback_url)")


def secret_ttl_s(body: dict[str, Any]) -> int | None:
    """``expires_after.seconds`` when within :data:`TTL_S` (else the service's default)."""
    after = body.get("expires_after") or {}
    seconds = after.get("seconds") if isinstance(after, dict) else None
    return seconds if isinstance(seconds, int) and TTL_S[0] <= seconds <= TTL_S[1] else None


def secret_callback(body: dict[str, Any]) -> str | None:
    """The body's ``callback_url`` (this service's own field); 400 unless a short string."""
    callback = body.get("callback_url")
    if callback is not None and (not isinstance(callback, str) or len(callback) > MAX_URL):
        raise BadRequest(f"callback_url must be a URL of at most {MAX_URL} characters",
                         field="callback_url")
    return callback or None
