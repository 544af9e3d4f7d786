"""Errors at the HTTP edge: where every error becomes an answer, in one place.

The core raises plain errors (app/errors.py: a type, a message, details, ``retry_after`` and
``no_retry``); here they get their HTTP status (:data:`STATUS`, one table, found along the
class's MRO so a subclass answers as its parent unless listed), their headers (``Retry-After``,
``x-should-retry: false``) and their body: the native shape ``{"error": {"type", "message",
...details}}``, or OpenAI's ``{"error": {"message", "type", "param", "code"}}`` that its SDKs
parse, under ``/v1/``. The errors only the edge raises (a missing key, a cross-site request, a
synchronous wait that timed out, ...) are declared here too.

One :func:`reply_for` renders every error, whoever catches it: FastAPI's exception handlers
(:func:`install_error_handlers`), the OpenAI routes (:class:`OpenAIRoute`), the ASGI
middleware that answers before any route runs (:meth:`Reply.send`, :meth:`Reply.deny`), and
the OpenAI answers built without an exception (:func:`openai_reply`); the live socket's error
events (:func:`socket_error`) and the OpenAI stream's (:func:`openai_body`) take their shapes
from here. Five places rendered errors before, two of them by hand. The bytes are those the
service always sent: routes answer through ``JSONResponse`` (compact JSON), middleware through
``json.dumps`` (its default spacing).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Scope, Send

from app.errors import (
    INTERNAL_MESSAGE,
    BadRequest,
    Conflict,
    DiarizationFailed,
    DiarizationOff,
    DiarizationUnavailable,
    FetchFailed,
    InvalidAudio,
    NotFound,
    NotReady,
    Overloaded,
    PayloadTooLarge,
    ServiceError,
    StoreUnavailable,
    TranscriptionFailed,
    UnsupportedMedia,
)

log = logging.getLogger(__name__)
OPENAI_PREFIX = "/v1/"
OPENAI_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}


# ---- the errors only the edge raises ------------------------------------------------------------
class Unauthorized(ServiceError):
    error_type = "unauthorized"


class CrossSiteRefused(ServiceError):
    error_type = "cross_site_refused"
    no_retry = True


class MisdirectedHost(ServiceError):
    error_type = "host_not_allowed"


class OpenWithoutKeys(ServiceError):
    error_type = "open_without_keys"
    no_retry = True


class MissingInput(ServiceError):
    """Neither a file nor an ``audio_url`` (or both): the shape of a validation error."""

    error_type = "invalid_request"


class ModelNotFound(ServiceError):
    error_type = "model_not_found"


class StillRunning(ServiceError):
    """A synchronous route's wait ended before its job did."""

    error_type = "timeout"


class Restarting(ServiceError):
    """The service drained while a synchronous route waited: retry elsewhere."""

    error_type = "shutting_down"


# ---- the HTTP mapping ---------------------------------------------------------------------------
STATUS: dict[type[ServiceError], int] = {
    ServiceError: 500, TranscriptionFailed: 500, DiarizationFailed: 500,
    BadRequest: 400, DiarizationOff: 400,
    Unauthorized: 401, CrossSiteRefused: 403, NotFound: 404, ModelNotFound: 404,
    Conflict: 409, PayloadTooLarge: 413, UnsupportedMedia: 415, MisdirectedHost: 421,
    InvalidAudio: 422, MissingInput: 422, Overloaded: 429,
    FetchFailed: 502,
    NotReady: 503, StoreUnavailable: 503, DiarizationUnavailable: 503, OpenWithoutKeys: 503,
    Restarting: 503,
    StillRunning: 504,
}


def status_of(error: ServiceError | type[ServiceError] | str) -> int:
    """The HTTP status of an error, its class, or a stored job error's ``type`` (500 for a type
    no class declares, such as ``internal_error``)."""
    if isinstance(error, str):
        found = _class_of(error)
        if found is None:
            return 500
        error = found
    cls = error if isinstance(error, type) else type(error)
    return next((STATUS[c] for c in cls.__mro__ if c in STATUS), 500)


def _class_of(error_type: str) -> type[ServiceError] | None:
    todo: list[type[ServiceError]] = [ServiceError]
    while todo:
        cls = todo.pop()
        if cls.error_type == error_type:
            return cls
        todo.extend(cls.__subclasses__())
    return None


def headers_of(error: ServiceError) -> dict[str, str]:
    """The client's two hints as headers: when to retry, and that no retry can help (what
    OpenAI's SDKs read)."""
    out = {}
    if error.retry_after is not None:
        out["Retry-After"] = str(error.retry_after)
    if error.no_retry:
        out["x-should-retry"] = "false"
    return out


def openai_body(status: int, message: str, *, code: str | None = None,
                param: str | None = None) -> dict[str, Any]:
    etype = OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": etype, "param": param, "code": code}}


class ErrorInfo(BaseModel):
    type: str
    message: str


class ErrorBody(BaseModel):  # the native error shape, as /docs shows it (no docstring: the spec's)
    error: ErrorInfo


# ---- rendering ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Reply:
    """An error as an answer: its status, body and headers, sent by a route or a middleware."""

    status: int
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status, headers=self.headers)

    async def send(self, send: Send, *, close: bool = False,
                   extra: list[tuple[bytes, bytes]] | None = None) -> None:
        """As a middleware's answer, before any route runs. ``close``: the rest of the request
        body is not read, so the connection cannot be reused (``Connection: close``)."""
        body = json.dumps(self.body).encode()
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode())]
        if close:
            headers.append((b"connection", b"close"))
        headers += [(k.lower().encode(), v.encode()) for k, v in self.headers.items()]
        await send({"type": "http.response.start", "status": self.status,
                    "headers": [*headers, *(extra or [])]})
        await send({"type": "http.response.body", "body": body})

    async def deny(self, scope: Scope, send: Send,
                   extra: list[tuple[bytes, bytes]] | None = None) -> None:
        """Refuse a request before any route runs. A WebSocket handshake gets the same JSON
        answer where the server speaks ASGI's denial-response extension (uvicorn does), else a
        close before the accept (the client sees HTTP 403)."""
        if scope["type"] == "http":
            await self.send(send, extra=extra)
            return
        if "websocket.http.response" not in scope.get("extensions", {}):
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps(self.body).encode()
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode()),
                   *((k.lower().encode(), v.encode()) for k, v in self.headers.items()),
                   *(extra or [])]
        await send({"type": "websocket.http.response.start", "status": self.status,
                    "headers": headers})
        await send({"type": "websocket.http.response.body", "body": body})


def reply_for(exc: Exception, *, openai: bool = False) -> Reply:
    """The answer to an error: a :class:`ServiceError`, FastAPI's validation error, Starlette's
    HTTP error, or anything else (a bug: 500, logged). ``openai``: in OpenAI's shape, where a
    validation error is a 400 naming the parameter, as OpenAI answers."""
    if isinstance(exc, ServiceError):
        status = status_of(exc)
        if openai:
            param = exc.details.get("field")
            body = openai_body(status, exc.message, code=exc.error_type,
                               param=str(param) if param else None)
        else:
            body = exc.body()
        return Reply(status, body, headers_of(exc))
    if isinstance(exc, RequestValidationError):
        errs = exc.errors()
        if openai:
            loc = [str(p) for p in (errs[0].get("loc", ()) if errs else ()) if p != "body"]
            msg = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ())[1:])}: {e.get('msg')}"
                            for e in errs) or "invalid request"
            return Reply(400, openai_body(400, msg, code="invalid_value",
                                          param=".".join(loc) or None))
        fields = [{"field": ".".join(str(p) for p in e.get("loc", ())), "message": e.get("msg", "")}
                  for e in errs]
        msg = "; ".join(f"{e['field']}: {e['message']}" for e in fields) or "invalid request"
        return Reply(422, {"error": {"type": "invalid_request", "message": msg, "fields": fields}})
    if isinstance(exc, StarletteHTTPException):
        headers = dict(exc.headers or {})
        if openai:
            return Reply(exc.status_code, openai_body(exc.status_code, str(exc.detail)), headers)
        return Reply(exc.status_code, {"error": {"type": "http_error", "message": str(exc.detail)}},
                     headers)
    log.exception("unhandled error", exc_info=exc)
    return Reply(500, {"error": {"type": "internal_error", "message": INTERNAL_MESSAGE}})


def edge_reply(error: ServiceError, path: str) -> Reply:
    """A middleware's answer to ``error`` on ``path``: OpenAI's shape under ``/v1/``."""
    return reply_for(error, openai=path.startswith(OPENAI_PREFIX))


def openai_reply(status: int, message: str, *, code: str | None = None,
                 param: str | None = None, headers: Mapping[str, str] | None = None
                 ) -> JSONResponse:
    """An OpenAI error answered without an exception (a job that failed, timed out, or ran into
    a drain; an unknown /v1 path)."""
    return Reply(status, openai_body(status, message, code=code, param=param),
                 dict(headers or {})).response()


def socket_error(code: str, message: str, param: str | None = None) -> dict[str, Any]:
    """A refusal on the live socket, as OpenAI's Realtime API sends it: an ``error`` event
    (app/live/events.py has the session's own)."""
    return {"type": "error", "event_id": None, "error": {
        "type": "invalid_request_error", "code": code, "message": message, "param": param,
        "event_id": None}}


class OpenAIRoute(APIRoute):
    """Renders every error raised while handling a /v1 request in OpenAI's shape."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            try:
                return await handler(request)
            except (ServiceError, RequestValidationError, StarletteHTTPException) as exc:
                return reply_for(exc, openai=True).response()

        return handle


def install_error_handlers(app: FastAPI) -> None:
    """Every other route's errors, in the native shape."""

    async def handle(_: Request, exc: Exception) -> Response:
        return reply_for(exc).response()

    for kind in (ServiceError, RequestValidationError, StarletteHTTPException, Exception):
        app.add_exception_handler(kind, handle)
