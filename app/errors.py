"""The service's errors, as every layer raises them: plain exceptions, no HTTP in them.

A :class:`ServiceError` says what went wrong in the client's terms: a machine-readable
``error_type``, a message, details for the client (``field``, ``limit``, ...) and two hints a
client acts on: ``retry_after`` (seconds until trying again may work) and ``no_retry`` (no retry
can change the answer). The audio decoder, the batcher, the job runner, admission, the speaker
models and the outbound fetcher raise them; a job's stored error is :meth:`ServiceError.body`'s
inner object. What each becomes on the wire (the HTTP status, ``Retry-After`` and
``x-should-retry`` headers, OpenAI's error shape under ``/v1/``) is decided at the edge, in one
place: app/api/errors.py. This module imports no web framework (an import-linter contract in
pyproject.toml keeps FastAPI and Starlette inside ``app/api`` and ``app/main.py``), so the core
can be run and tested without one, as the Ray path (app/dataset) runs it.

Anything that is not a ServiceError is a bug: the edge answers it with a 500 that still says so
in JSON, never an HTML page or a hung request.
"""

from __future__ import annotations

import re
from typing import Any


class ServiceError(Exception):
    """Base: an error the client is told about, with its type and details."""

    error_type = "internal_error"
    no_retry = False  # a class whose every instance no retry can fix says so here

    def __init__(self, message: str, *, retry_after: int | None = None,
                 no_retry: bool | None = None, **details: Any) -> None:
        if "headers" in details or "status_code" in details:  # HTTP is the edge's business
            raise TypeError("a ServiceError carries retry_after and no_retry; its status and "
                            "headers are app/api/errors.py's")
        super().__init__(message)
        self.message = message
        self.details = details
        self.retry_after = retry_after
        if no_retry is not None:
            self.no_retry = no_retry

    def body(self) -> dict[str, Any]:
        """``{"error": {"type", "message", ...details}}``: the native API's answer, and (its
        inner object) what a failed job records."""
        return {"error": {"type": self.error_type, "message": self.message, **self.details}}


class BadRequest(ServiceError):
    error_type = "bad_request"


class InvalidChunking(BadRequest):
    """Not a chunking strategy (OpenAI's ``chunking_strategy``) this service can follow: the
    request's settings are invalid, or this service's VAD cannot take them."""

    no_retry = True

    def __init__(self, message: str) -> None:
        super().__init__(message, field="chunking_strategy")


class NotFound(ServiceError):
    error_type = "not_found"


class Conflict(ServiceError):
    error_type = "conflict"


class PayloadTooLarge(ServiceError):
    error_type = "payload_too_large"


class UnsupportedMedia(ServiceError):
    error_type = "unsupported_media"


class InvalidAudio(ServiceError):
    error_type = "invalid_audio"


class DecoderCrashed(InvalidAudio):
    """An upload whose decoding killed a prep process twice (a decoder bug on a hostile or
    broken file): its job fails alone, as the client's input (422, as ``InvalidAudio``), and
    no retry can help."""

    error_type = "decoder_crashed"
    no_retry = True


class Overloaded(ServiceError):
    """Past a bound (the backlog, a key's share, its streams or transfers): later may work."""

    error_type = "overloaded"


class NotReady(ServiceError):
    error_type = "not_ready"


class StoreUnavailable(ServiceError):
    """The job store cannot be reached now (a PostgreSQL restart or failover): retry shortly;
    ``detail`` (what the driver said) is for the log."""

    error_type = "store_unavailable"

    def __init__(self, detail: str) -> None:
        super().__init__("the job store is unavailable for a moment; retry shortly",
                         retry_after=1)
        self.detail = detail


class FetchFailed(ServiceError):
    """An ``audio_url``'s remote end failed (unreachable, timed out, answered 5xx): maybe not
    for long (app/net/fetch.py)."""

    error_type = "fetch_failed"


class TranscriptionFailed(ServiceError):
    """Inference failed for a window; carried to the one job that owns it."""

    error_type = "transcription_failed"


class DiarizationOff(ServiceError):
    """Speakers were asked for on a service that runs without them (``speakers.load=off``)."""

    error_type = "diarization_off"
    no_retry = True


class DiarizationUnavailable(ServiceError):
    """Speakers were asked for and the speaker models could not be loaded (not provisioned,
    or broken): an operator has to act, so clients are told not to retry."""

    error_type = "diarization_unavailable"
    no_retry = True


class DiarizationFailed(ServiceError):
    """The speaker models failed on this job's audio; carried to the job."""

    error_type = "diarization_failed"


class ShuttingDown(Exception):
    """The batcher stopped before this work ran; the job stays queued for the next start."""


# An absolute filesystem path (two segments or more) not inside a URL: FFmpeg's messages name
# the file they failed on, and that is the server's spool path.
_PATH = re.compile(r"(?<![\w:/.~-])/(?:[^\s/'\"]+/)+[^\s/'\",;)]*")
# An IPv4 address (with its port), or a bracketed IPv6 one: where the service connects.
_ADDRESS = re.compile(r"\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b|\[[0-9a-fA-F:.]+\](?::\d+)?")
INTERNAL_MESSAGE = "internal error; see the server log"
# Failures of the engines and the speaker models: their exception's text never reaches a client
# (it names devices, paths, data); rows stored before it was kept out lose it here, at the
# first ": " after the service's own words. Their ``cause`` is shown only when it is one of ours.
ENGINE_FAILURES = frozenset({"transcription_failed", "diarization_failed"})
PUBLIC_CAUSES = frozenset({"out_of_memory", "engine_error", "too_many_attempts"})


def public_error(error: dict[str, Any] | None) -> dict[str, Any] | None:
    """A stored job error as clients may see it, the one renderer of job errors on every route
    (GET /jobs, ?wait=true, /v1 and its stream, /asr, /detect-language, events, webhooks): no
    exception text, no server path, no address. An unexpected failure says only that it
    happened; the log has the rest."""
    if not error:
        return error
    out = dict(error)
    kind = out.get("type")
    if kind in (None, "internal_error"):
        return {"type": "internal_error", "message": INTERNAL_MESSAGE}
    message = out.get("message")
    if not isinstance(message, str):
        message = str(kind)
    if kind in ENGINE_FAILURES:
        if out.get("cause") != "too_many_attempts":  # that message is the service's own
            message = message.split(": ", 1)[0]
        if out.get("cause") not in PUBLIC_CAUSES:
            out.pop("cause", None)
    out["message"] = _ADDRESS.sub("<address>", _PATH.sub("<file>", message))
    return out
