"""``audio_url``: the service downloads the audio itself, into the spool file an upload would have
been written to, as part of the job (app/jobs/fetching.py: the request is answered before the
first byte); from there the audio is probed and admitted exactly like an upload's.

* ``http(s)://`` through the outbound guard (:mod:`app.net.outbound`): the destination is checked
  at submit and again where the connection is made, no redirects are followed, and the whole
  download runs under ``outbound.fetch_timeout_s``.
* ``s3://bucket/key`` with the blob store's credentials (``storage.s3_endpoint_url`` and the
  usual ``AWS_*`` variables), only from buckets listed in ``outbound.s3_buckets``, and never
  from the blob store's own prefix (other tenants' uploads live there).

Limits apply while the bytes stream: a declared ``Content-Length`` over
``limits.max_upload_bytes`` is refused before the body is read, the count is checked on every
chunk, and once ``PROBE_AFTER_BYTES`` have arrived the container header is probed, so a file
that says it is longer than ``limits.max_audio_s`` is stopped there. The job records the URL
without credentials (user info and signature-like query values are dropped), never a copy of
the service's keys.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from app import audio
from app.config import Settings
from app.errors import BadRequest, Overloaded, PayloadTooLarge, ServiceError
from app.net.outbound import OutboundError, OutboundGuard
from app.net.s3 import s3_client, s3_location

PROBE_AFTER_BYTES = 1 << 20  # enough for any container header we accept (WAV's is 44 bytes)
WRITE_BLOCK = 1 << 20
SECRET_PARAM = re.compile(r"sig|token|key|credential|secret|pass|auth", re.IGNORECASE)


class FetchFailed(ServiceError):
    """The remote end failed (unreachable, timed out, answered 5xx): maybe not for long."""

    status_code = 502
    error_type = "fetch_failed"


@dataclass(frozen=True)
class Fetched:
    size: int
    filename: str | None
    url: str  # what the job records: no credentials


Progress = Callable[[int], None]  # bytes received so far
BUSY_WAIT_S = 1.0  # the outbound slots (in all, or of this host) are taken: try again then


def is_s3(url: str) -> bool:
    return url.strip().lower().startswith("s3://")


async def check_audio_url(settings: Settings, guard: OutboundGuard, url: str) -> str:
    """At submit, before the job exists (400 for a URL that cannot be fetched): ``s3://`` must
    name a listed bucket, anything else passes the outbound guard's checks."""
    url = url.strip()
    if is_s3(url):
        s3_checked(settings, url)
        return url
    return await guard.check_url(url, "audio_url")


def file_name_of(url: str) -> str | None:
    return file_name(s3_location(url)[1] if is_s3(url) else urlsplit(url).path)


def recorded_url_of(url: str) -> str:
    return url if is_s3(url) else recorded_url(url)


async def fetch_audio(settings: Settings, guard: OutboundGuard, url: str, dest: Path,
                      progress: Progress | None = None) -> Fetched:
    """Download ``url`` to ``dest`` (fsynced), enforcing the limits while it streams. HTTP and
    ``s3://`` alike hold one of the outbound guard's slots (in all, and per host or bucket)
    while they run, waiting for one while they are all taken, within the fetch deadline."""
    url = url.strip()
    deadline = time.monotonic() + settings.outbound.fetch_timeout_s
    while True:
        try:
            if is_s3(url):
                bucket = s3_checked(settings, url)[0]
                with guard.slot(f"s3:{bucket}") as got:
                    if not got:
                        raise Overloaded("the outbound slots are taken", field="audio_url")
                    return await asyncio.to_thread(fetch_s3, settings, url, dest, progress)
            url = await guard.check_url(url, "audio_url")
            return await fetch_http(settings, guard, url, dest, progress)
        except Overloaded:  # only raised for taken slots, before a byte was read
            if time.monotonic() + BUSY_WAIT_S > deadline:
                raise FetchFailed("audio_url could not be fetched (busy)",
                                  field="audio_url") from None
            await asyncio.sleep(BUSY_WAIT_S)


def too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"audio_url's file exceeds the limit of {limit} bytes",
                           limit_bytes=limit, field="audio_url")


class _Sink:
    """The spool file being filled: size limit per chunk, one early duration probe."""

    def __init__(self, dest: Path, settings: Settings) -> None:
        self.dest = dest
        self.max_bytes = settings.limits.max_upload_bytes
        self.max_audio_s = settings.limits.max_audio_s
        self.size = 0
        self.probed = False
        self.file: IO[bytes] = dest.open("wb")

    def write(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self.max_bytes:
            raise too_large(self.max_bytes)
        self.file.write(chunk)
        if not self.probed and self.size >= PROBE_AFTER_BYTES:
            self.probed = True
            self.file.flush()
            try:  # only the duration matters here; the full probe follows the download
                audio.probe(self.dest, self.max_audio_s)
            except PayloadTooLarge:
                raise
            except ServiceError:
                pass

    def close(self, ok: bool) -> None:
        try:
            if ok:
                self.file.flush()
                os.fsync(self.file.fileno())
        finally:
            self.file.close()


async def fetch_http(settings: Settings, guard: OutboundGuard, url: str, dest: Path,
                     progress: Progress | None = None) -> Fetched:
    sink = await asyncio.to_thread(_Sink, dest, settings)
    ok = False
    try:
        async with guard.stream("GET", url, deadline_s=settings.outbound.fetch_timeout_s) as resp:
            status = resp.status_code
            if 300 <= status < 400:
                raise BadRequest(f"audio_url answered with a redirect (HTTP {status}); redirects "
                                 "are not followed: give the final URL", field="audio_url")
            if status >= 500:
                raise FetchFailed(f"audio_url answered HTTP {status}", field="audio_url")
            if status >= 400:
                raise BadRequest(f"audio_url answered HTTP {status}", field="audio_url")
            declared = resp.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > sink.max_bytes:
                raise too_large(sink.max_bytes)
            block = bytearray()
            got = 0
            async for chunk in resp.aiter_raw():
                block += chunk
                got += len(chunk)
                if progress is not None:
                    progress(got)
                if len(block) >= WRITE_BLOCK or (not sink.probed and
                                                 sink.size + len(block) >= PROBE_AFTER_BYTES):
                    await asyncio.to_thread(sink.write, bytes(block))
                    block.clear()
            await asyncio.to_thread(sink.write, bytes(block))
        ok = True
    except OutboundError as exc:
        if exc.category == "busy":
            raise Overloaded("too many downloads from this host are in flight; retry shortly",
                             headers={"Retry-After": "2"}, field="audio_url") from None
        if exc.category in ("refused", "invalid_url"):
            raise BadRequest(f"audio_url could not be fetched ({exc.public})",
                             field="audio_url") from None
        raise FetchFailed(f"audio_url could not be fetched ({exc.public})",
                          field="audio_url") from None
    finally:
        await asyncio.to_thread(sink.close, ok)
    return Fetched(sink.size, file_name(urlsplit(url).path), recorded_url(url))


def s3_checked(settings: Settings, url: str) -> tuple[str, str]:
    """``s3://bucket/key``'s parts, or 400 unless the bucket is one the service reads from."""
    try:
        bucket, key = s3_location(url.strip())
    except ValueError:
        raise BadRequest("audio_url must look like s3://bucket/key", field="audio_url") from None
    if not key or not s3_allowed(settings, bucket, key):
        raise BadRequest("audio_url names an S3 bucket this service does not read from "
                         "(outbound.s3_buckets)", field="audio_url")
    return bucket, key


def fetch_s3(settings: Settings, url: str, dest: Path, progress: Progress | None = None) -> Fetched:
    """Blocking (boto3): runs on a worker thread."""
    bucket, key = s3_checked(settings, url)
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError

    out = settings.outbound
    client = s3_client(settings.storage.s3_endpoint_url, Config(
        connect_timeout=out.connect_timeout_s, read_timeout=min(60.0, out.fetch_timeout_s),
        retries={"max_attempts": 2}))
    deadline = time.monotonic() + out.fetch_timeout_s
    sink = _Sink(dest, settings)
    ok = False
    try:
        obj = client.get_object(Bucket=bucket, Key=key)
        if int(obj.get("ContentLength") or 0) > sink.max_bytes:
            raise too_large(sink.max_bytes)
        with contextlib.closing(obj["Body"]) as body:
            for chunk in body.iter_chunks(WRITE_BLOCK):
                sink.write(chunk)
                if progress is not None:
                    progress(sink.size)
                if time.monotonic() > deadline:
                    raise FetchFailed("audio_url could not be fetched (unreachable)", field="audio_url")
        ok = True
    except ClientError as exc:
        code = str(exc.response.get("Error", {}).get("Code", ""))
        if code in ("NoSuchKey", "NoSuchBucket", "404", "AccessDenied", "403"):
            raise BadRequest("audio_url: no such object, or no access to it",
                             field="audio_url") from None
        raise FetchFailed("audio_url could not be fetched (s3_error)", field="audio_url") from None
    except BotoCoreError:
        raise FetchFailed("audio_url could not be fetched (unreachable)",
                          field="audio_url") from None
    finally:
        sink.close(ok)
    return Fetched(sink.size, file_name(key), f"s3://{bucket}/{key}")


def s3_allowed(settings: Settings, bucket: str, key: str) -> bool:
    """Listed in ``outbound.s3_buckets`` ('bucket' or 'bucket/prefix'), and not the blob
    store's own prefix."""
    own = settings.storage.blob_url.strip()
    if own.startswith("s3://"):
        own_bucket, own_prefix = s3_location(own)
        if bucket == own_bucket and key.startswith(own_prefix):
            return False
    for entry in settings.outbound.s3_buckets:
        b, _, prefix = entry.strip().removeprefix("s3://").partition("/")
        if b == bucket and key.startswith(prefix):
            return True
    return False


def file_name(path: str) -> str | None:
    return PurePosixPath(unquote(path)).name or None


def recorded_url(url: str) -> str:
    """``url`` as a job may show it: no user info, signature-like query values dropped."""
    p = urlsplit(url)
    host = p.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = host + (f":{p.port}" if p.port else "")
    query = urlencode([(k, "REDACTED" if SECRET_PARAM.search(k) else v)
                       for k, v in parse_qsl(p.query, keep_blank_values=True)])
    return urlunsplit((p.scheme, netloc, p.path, query, ""))
