"""Per-field size limits of a multipart form, judged while the body streams in.

Starlette's form parser has one ``max_part_size`` for every field of a route. The service caps
fields at 64 KiB (app/main.py ``FORM_LIMITS``), but ``/v1/audio/transcriptions`` takes OpenAI's
``known_speaker_references[]``: data URLs of reference clips, up to 4 MiB each. Raising the
route's limit raised it for all 32 fields (issue 51): 128 MiB of form fields held in memory
per request. :class:`FieldMeter` reads the same bytes the route's parser will, with
python-multipart's streaming parser (what Starlette uses), as they pass, and cuts the request
off (413 naming the field) the moment a field passes its own limit: ``FIELD_LIMITS`` for the
listed fields, 64 KiB for any other. One too many of a listed field is the request's mistake,
not its size: a 400 with the text the route itself gives (OpenAI's 1 to 4 known speakers), so
a client sees the same answer whether the form is cut off here or checked by the route. File
parts are the body limit's (app/api/middleware/limits.py).
"""

from __future__ import annotations

from typing import NamedTuple

from python_multipart.multipart import MultipartParser, parse_options_header

from app.errors import BadRequest, PayloadTooLarge, ServiceError
from app.speakers.limits import MAX_KNOWN, PART_BYTES

FIELD_BYTES = 64 * 1024  # any other field (app/main.py FORM_LIMITS' max_part_size)


class FieldLimit(NamedTuple):
    max_bytes: int  # per field
    max_fields: int  # fields of that name at most
    too_many: str  # the 400's text past ``count``
    names: str  # the field the 400 names (the route's own check names the same)


# Per route: field name -> its limit.
FIELD_LIMITS: dict[str, dict[str, FieldLimit]] = {
    "/v1/audio/transcriptions": {"known_speaker_references[]": FieldLimit(
        PART_BYTES, MAX_KNOWN, f"give 1 to {MAX_KNOWN} known speakers", "known_speaker_names[]")},
}


def field_too_large(name: str, limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"form field {name[:100]!r} is over its limit of {limit} bytes",
                           limit_bytes=limit, field=name[:100])


class FieldMeter:
    """Fed the body's chunks (:meth:`feed`); raises :class:`PayloadTooLarge` for a field over
    its limit, :class:`BadRequest` for one too many of a limited name. A body it cannot parse
    is left to the route's parser, which answers it (400)."""

    def __init__(self, content_type: str, limits: dict[str, FieldLimit]) -> None:
        _, params = parse_options_header(content_type)
        self.limits = limits
        self.seen: dict[str, int] = {}
        self._name, self._file, self._size = "", False, 0
        self._header, self._value = b"", b""
        self._error: ServiceError | None = None
        boundary = params.get(b"boundary")
        self._parser: MultipartParser | None = MultipartParser(boundary, {
            "on_part_begin": self._begin, "on_part_data": self._data,
            "on_header_field": self._header_field, "on_header_value": self._header_value,
            "on_header_end": self._header_end,
        }) if boundary else None

    def feed(self, chunk: bytes) -> None:
        if self._parser is None or not chunk:
            return
        try:
            self._parser.write(chunk)
        except Exception:  # not a form we can read: the route's parser says why
            self._parser = None
        if self._error is not None:
            raise self._error

    def _begin(self) -> None:
        self._name, self._file, self._size = "", False, 0

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._header += data[start:end]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]

    def _header_end(self) -> None:
        if self._header.lower() == b"content-disposition":
            _, options = parse_options_header(self._value)
            self._name = options.get(b"name", b"").decode("utf-8", "replace")
            self._file = b"filename" in options
            if not self._file and self._name in self.limits:
                n = self.seen[self._name] = self.seen.get(self._name, 0) + 1
                limit = self.limits[self._name]
                if n > limit.max_fields:
                    self._fail(BadRequest(limit.too_many, field=limit.names))
        self._header, self._value = b"", b""

    def _data(self, data: bytes, start: int, end: int) -> None:
        if self._file:
            return
        self._size += end - start
        limit = self.limits[self._name].max_bytes if self._name in self.limits else FIELD_BYTES
        if self._size > limit:
            self._fail(field_too_large(self._name, limit))

    def _fail(self, error: ServiceError) -> None:
        if self._error is None:
            self._error = error
