"""A JSON body for a form route: ``POST /transcribe`` with ``{"audio_url": ..., "language": ...}``.

The JSON object is turned into the urlencoded form it stands for before FastAPI reads the body,
so both bodies go through the same form parameters: the same names, bounds, defaults and 422s,
and a form field added later works in JSON at once. Only flat objects of scalars (and lists of
scalars, for repeated fields) are accepted, at most ``MAX_JSON_BYTES``. The OpenAPI description
gets the JSON alternative too (:func:`describe_json_bodies`): the form's schema without its
file, the listed fields required.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Coroutine
from typing import Any
from urllib.parse import urlencode

from fastapi import FastAPI, Request, params
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import TypeAdapter, ValidationError
from starlette.responses import Response
from starlette.types import Message

MAX_JSON_BYTES = 64 * 1024
JSON_TYPES = ("application/json",)
# Routes that take JSON, and the fields the JSON body must have (a file cannot be JSON).
JSON_ROUTES: dict[tuple[str, str], tuple[str, ...]] = {("post", "/transcribe"): ("audio_url",)}


def invalid(message: str) -> RequestValidationError:
    return RequestValidationError([{"type": "json_invalid", "loc": ("body",), "msg": message,
                                    "input": None}])


def form_pairs(data: Any, fields: dict[str, TypeAdapter[Any]]) -> list[tuple[str, str]]:
    """The form fields a JSON object stands for; each value must have its field's JSON type
    (strict: ``"3"`` is not an integer), the form's own bounds are checked afterwards."""
    if not isinstance(data, dict):
        raise invalid("the JSON body must be an object of fields")
    errors = []
    for name, value in data.items():
        if name not in fields:
            errors.append({"type": "extra_forbidden", "loc": ("body", name),
                           "msg": "Extra inputs are not permitted", "input": value})
            continue
        try:
            fields[name].validate_python(value, strict=True)
        except ValidationError as exc:
            errors += [{**e, "loc": ("body", name, *e["loc"])} for e in exc.errors()]
    if errors:
        raise RequestValidationError(errors)
    pairs: list[tuple[str, str]] = []
    for name, value in data.items():
        for item in value if isinstance(value, list) else [value]:
            if item is None:
                continue
            if isinstance(item, bool):
                pairs.append((name, "true" if item else "false"))
            elif isinstance(item, str | int | float):
                pairs.append((name, str(item)))
            else:
                raise invalid(f"field {name!r}: only strings, numbers and booleans are accepted")
    return pairs


async def read_capped(request: Request, limit: int) -> bytes:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise invalid(f"the JSON body is larger than {limit} bytes")
    return bytes(body)


class JsonFormRoute(APIRoute):
    """A form route that also accepts ``application/json`` (see the module docstring)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        fields = {f.alias: TypeAdapter(f.field_info.annotation or Any)
                  for f in self.dependant.body_params if not isinstance(f.field_info, params.File)}

        async def handle(request: Request) -> Response:
            ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
            if ctype not in JSON_TYPES:
                return await handler(request)
            raw = await read_capped(request, MAX_JSON_BYTES)
            try:
                data = json.loads(raw or b"null")
            except (ValueError, UnicodeDecodeError):
                raise invalid("the body is not valid JSON") from None
            form = urlencode(form_pairs(data, fields)).encode()
            scope = dict(request.scope)
            scope["headers"] = [
                *((k, v) for k, v in request.scope["headers"]
                  if k not in (b"content-type", b"content-length")),
                (b"content-type", b"application/x-www-form-urlencoded"),
                (b"content-length", str(len(form)).encode()),
            ]
            sent = False

            async def receive() -> Message:
                nonlocal sent
                if not sent:
                    sent = True
                    return {"type": "http.request", "body": form, "more_body": False}
                return await request.receive()  # the disconnect, when it comes

            return await handler(Request(scope, receive))

        return handle


def describe_json_bodies(app: FastAPI) -> None:
    """Add each JSON route's ``application/json`` request body to the OpenAPI description."""
    default_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        spec = default_openapi()
        schemas = spec.get("components", {}).get("schemas", {})
        for (method, path), required in JSON_ROUTES.items():
            body = spec.get("paths", {}).get(path, {}).get(method, {}).get("requestBody")
            if not body:
                continue
            form = body["content"].get("multipart/form-data", {}).get("schema", {})
            ref = form.get("$ref", "")
            schema = copy.deepcopy(schemas.get(ref.rsplit("/", 1)[-1], form))
            props = {k: v for k, v in schema.get("properties", {}).items()
                     if v.get("format") != "binary" and "contentMediaType" not in str(v)}
            body["content"]["application/json"] = {"schema": {
                "type": "object", "properties": props, "required": list(required),
                "additionalProperties": False,
                "description": "The form's fields as a JSON object, with audio_url instead of a file.",
            }}
        app.openapi_schema = spec
        return spec

    app.openapi = openapi  # type: ignore[method-assign]
