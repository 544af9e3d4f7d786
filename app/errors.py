"""Exceptions that know their HTTP status, and the one handler that renders them.

Code raises these anywhere (audio decoding, limits, the job store); the API turns them into a
JSON body ``{"error": {"type", "message", ...details}}``. Anything else is a bug and becomes a
500 that still says so in JSON, never an HTML page or a hung request.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

OPENAI_PREFIX = "/v1/"
OPENAI_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}


def openai_body(status: int, message: str, *, code: str | None = None,
                param: str | None = None) -> dict[str, Any]:
    etype = OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": etype, "param": param, "code": code}}


class ServiceError(Exception):
    """Base: an error with a status code, a machine-readable type and details for the client."""

    status_code = 500
    error_type = "internal_error"

    def __init__(self, message: str, *, headers: dict[str, str] | None = None, **details: Any):
        super().__init__(message)
        self.message = message
        self.details = details
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"type": self.error_type, "message": self.message, **self.details}}

    def body_for(self, path: str) -> dict[str, Any]:
        """:meth:`body`, or OpenAI's shape under ``/v1/`` (what its SDKs parse): also for the
        errors middleware answers before any route runs (401, 413)."""
        if not path.startswith(OPENAI_PREFIX):
            return self.body()
        field = self.details.get("field")
        return openai_body(self.status_code, self.message, code=self.error_type,
                           param=str(field) if field else None)


class BadRequest(ServiceError):
    status_code = 400
    error_type = "bad_request"


class NotFound(ServiceError):
    status_code = 404
    error_type = "not_found"


class Conflict(ServiceError):
    status_code = 409
    error_type = "conflict"


class PayloadTooLarge(ServiceError):
    status_code = 413
    error_type = "payload_too_large"


class UnsupportedMedia(ServiceError):
    status_code = 415
    error_type = "unsupported_media"


class InvalidAudio(ServiceError):
    status_code = 422
    error_type = "invalid_audio"


class Overloaded(ServiceError):
    status_code = 429
    error_type = "overloaded"


class NotReady(ServiceError):
    status_code = 503
    error_type = "not_ready"



class StoreUnavailable(ServiceError):
    """The job store cannot be reached now (a PostgreSQL restart or failover): 503, retry
    shortly; ``detail`` (what the driver said) is for the log."""

    status_code = 503
    error_type = "store_unavailable"

    def __init__(self, detail: str) -> None:
        super().__init__("the job store is unavailable for a moment; retry shortly",
                         headers={"Retry-After": "1"})
        self.detail = detail


class TranscriptionFailed(ServiceError):
    """Inference failed for a window; carried to the one job that owns it."""

    status_code = 500
    error_type = "transcription_failed"


NO_RETRY = {"x-should-retry": "false"}  # what OpenAI's clients read: a retry cannot help


class DiarizationOff(ServiceError):
    """Speakers were asked for on a service that runs without them (``speakers.load=off``)."""

    status_code = 400
    error_type = "diarization_off"

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message, headers=dict(NO_RETRY), **details)


class DiarizationUnavailable(ServiceError):
    """Speakers were asked for and the speaker models could not be loaded (not provisioned,
    or broken): an operator has to act, so clients are told not to retry."""

    status_code = 503
    error_type = "diarization_unavailable"

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message, headers=dict(NO_RETRY), **details)


class DiarizationFailed(ServiceError):
    """The speaker models failed on this job's audio; carried to the job."""

    status_code = 500
    error_type = "diarization_failed"


class ShuttingDown(Exception):
    """The batcher stopped before this work ran; the job stays queued for the next start."""


def status_of(error_type: str) -> int:
    """The HTTP status of a :class:`ServiceError` type name (a stored job error's ``type``);
    500 for a type no class declares (``internal_error``)."""
    todo: list[type[ServiceError]] = [ServiceError]
    while todo:
        cls = todo.pop()
        if cls.error_type == error_type:
            return cls.status_code
        todo.extend(cls.__subclasses__())
    return 500


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


def install_error_handlers(app: FastAPI) -> None:
    async def service_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ServiceError)
        return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers)

    async def validation_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        errors = [
            {"field": ".".join(str(p) for p in e.get("loc", ())), "message": e.get("msg", "")}
            for e in exc.errors()
        ]
        msg = "; ".join(f"{e['field']}: {e['message']}" for e in errors) or "invalid request"
        return JSONResponse(
            {"error": {"type": "invalid_request", "message": msg, "fields": errors}},
            status_code=422,
        )

    async def http_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        return JSONResponse(
            {"error": {"type": "http_error", "message": str(exc.detail)}},
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return JSONResponse(
            {"error": {"type": "internal_error", "message": "internal error; see the server log"}},
            status_code=500,
        )

    app.add_exception_handler(ServiceError, service_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)
