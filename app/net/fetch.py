"""``audio_url``: the service downloads the audio itself, into the spool file an upload would have
been written to, as part of the job (app/jobs/fetching.py: the request is answered before the
first byte); from there the audio is probed and admitted exactly like an upload's.

* ``http(s)://`` through the outbound guard (:mod:`app.net.outbound`): the destination is checked
  at submit and again where the connection is made, no redirects are followed, and the whole
  download runs under ``outbound.fetch_timeout_s``. The answer's headers must come within
  ``outbound.answer_timeout_s`` (else "unreachable", as a silent port reads), and from then on
  its average rate must stay at ``outbound.min_fetch_rate_bytes_s`` (:class:`RateRule`): a
  server trickling a byte a second is cut off after ``fetch_rate_grace_s``, not after the
  whole deadline, and the job's error names the URL's host and the rule.
* Every download holds one of the guard's slots, one of its key's (app/net/slots.py), waiting
  for one (event-driven, fairly between keys) within the fetch deadline.
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
from app.errors import BadRequest, FetchFailed, PayloadTooLarge, ServiceError
from app.net.outbound import OutboundError, OutboundGuard
from app.net.s3 import s3_client, s3_location

PROBE_AFTER_BYTES = 1 << 20  # enough for any container header we accept (WAV's is 44 bytes)
WRITE_BLOCK = 1 << 20
SECRET_PARAM = re.compile(r"sig|token|key|credential|secret|pass|auth", re.IGNORECASE)


@dataclass(frozen=True)
class Fetched:
    size: int
    filename: str | None
    url: str  # what the job records: no credentials


Progress = Callable[[int], None]  # bytes received so far


class RateRule:
    """The minimum average transfer rate of a download, from its headers on: at any time
    ``t`` past ``grace_s``, ``received >= min_rate * t``. :meth:`cut_at` is when the rule fails
    if nothing more arrives: the read in flight is given until then, so the rule is exact
    without a timer of its own."""

    def __init__(self, min_rate: int, grace_s: float, start: float) -> None:
        self.min_rate, self.grace_s, self.start = min_rate, grace_s, start
        self.received = 0

    def cut_at(self) -> float | None:
        if self.min_rate <= 0:
            return None
        return self.start + max(self.grace_s, self.received / self.min_rate)

    def add(self, n: int) -> None:
        self.received += n


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
                      progress: Progress | None = None, owner: str | None = None) -> Fetched:
    """Download ``url`` to ``dest`` (fsynced), enforcing the limits while it streams. HTTP and
    ``s3://`` alike hold one of the outbound guard's slots for ``owner`` (in all, at the
    destination, of the key), waiting for one while they are all taken, within the fetch
    deadline."""
    url = url.strip()
    deadline = time.monotonic() + settings.outbound.fetch_timeout_s
    try:
        if is_s3(url):
            bucket = s3_checked(settings, url)[0]
            async with guard.slot(owner, f"s3:{bucket}", settings.outbound.fetch_timeout_s):
                left = deadline - time.monotonic()
                return await asyncio.to_thread(fetch_s3, settings, url, dest, progress, left)
        url = await guard.check_url(url, "audio_url")
        return await fetch_http(settings, guard, url, dest, progress, owner, deadline)
    except OutboundError as exc:
        if exc.category == "busy":  # no slot within the whole deadline
            guard.cut_off("fetch", "busy")
            raise FetchFailed("audio_url could not be fetched: this service's outbound slots "
                              "stayed taken until its deadline; retry later",
                              field="audio_url") from None
        raise


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


class _CutOff(Exception):
    """The download broke one of the rules while its body streamed (carried out of the
    guard's stream untouched, then turned into the job's error)."""

    def __init__(self, rule: str) -> None:
        super().__init__(rule)
        self.rule = rule


async def fetch_http(settings: Settings, guard: OutboundGuard, url: str, dest: Path,
                     progress: Progress | None = None, owner: str | None = None,
                     deadline: float | None = None) -> Fetched:
    out = settings.outbound
    deadline = deadline if deadline is not None else time.monotonic() + out.fetch_timeout_s
    host = urlsplit(url).hostname or "?"
    sink = await asyncio.to_thread(_Sink, dest, settings)
    ok = False
    rule = RateRule(out.min_fetch_rate_bytes_s, out.fetch_rate_grace_s, time.monotonic())
    answered = False  # the headers arrived: from here a slow server is named, not "unreachable"
    left = max(0.0, deadline - time.monotonic())
    try:
        # One deadline over the whole download, the wait for a slot included.
        async with asyncio.timeout(left), guard.stream(
                "GET", url, deadline_s=left, key=owner, wait_s=left,
                answer_s=out.answer_timeout_s) as resp:
            answered = True
            rule.start = time.monotonic()
            check_answer(resp.status_code, resp.headers.get("content-length", ""), sink.max_bytes)
            block = bytearray()
            chunks = resp.aiter_raw()
            while True:
                cut = rule.cut_at()
                try:
                    async with asyncio.timeout(None if cut is None else cut - time.monotonic()):
                        chunk = await anext(chunks)
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    raise _CutOff("min_fetch_rate_bytes_s") from None
                rule.add(len(chunk))
                block += chunk
                if progress is not None:
                    progress(rule.received)
                if len(block) >= WRITE_BLOCK or (not sink.probed and
                                                 sink.size + len(block) >= PROBE_AFTER_BYTES):
                    await asyncio.to_thread(sink.write, bytes(block))
                    block.clear()
            await asyncio.to_thread(sink.write, bytes(block))
        ok = True
    except _CutOff as exc:
        guard.cut_off("fetch", "min_rate")
        raise FetchFailed(
            f"audio_url's host {host} sent {rule.received} bytes in "
            f"{time.monotonic() - rule.start:.0f} s, under this service's minimum transfer rate "
            f"of {out.min_fetch_rate_bytes_s} bytes/s (outbound.min_fetch_rate_bytes_s); the "
            "download was cut off", field="audio_url", rule=exc.rule) from None
    except PayloadTooLarge:
        guard.cut_off("fetch", "size")
        raise
    except TimeoutError:  # the whole deadline passed: waiting for a slot, or reading the body
        if not answered:
            raise FetchFailed("audio_url could not be fetched within this service's deadline of "
                              f"{out.fetch_timeout_s:g} s (unreachable, or its outbound slots "
                              "stayed busy)", field="audio_url", rule="fetch_timeout_s") from None
        raise _deadline(guard, host, out.fetch_timeout_s) from None
    except OutboundError as exc:
        if exc.category == "timeout" and answered:
            raise _deadline(guard, host, out.fetch_timeout_s) from None
        if exc.category == "busy":
            raise
        if exc.category in ("refused", "invalid_url"):
            raise BadRequest(f"audio_url could not be fetched ({exc.public})",
                             field="audio_url") from None
        raise FetchFailed(f"audio_url could not be fetched ({exc.public})",
                          field="audio_url") from None
    finally:
        await asyncio.to_thread(sink.close, ok)
    return Fetched(sink.size, file_name(urlsplit(url).path), recorded_url(url))


def _deadline(guard: OutboundGuard, host: str, limit_s: float) -> FetchFailed:
    guard.cut_off("fetch", "deadline")
    return FetchFailed(f"audio_url's host {host} did not finish sending within this service's "
                       f"deadline of {limit_s:g} s (outbound.fetch_timeout_s); the download was "
                       "cut off", field="audio_url", rule="fetch_timeout_s")


def check_answer(status: int, declared: str, max_bytes: int) -> None:
    """The answer's status line and declared length, before its body is read."""
    if 300 <= status < 400:
        raise BadRequest(f"audio_url answered with a redirect (HTTP {status}); redirects "
                         "are not followed: give the final URL", field="audio_url")
    if status >= 500:
        raise FetchFailed(f"audio_url answered HTTP {status}", field="audio_url")
    if status >= 400:
        raise BadRequest(f"audio_url answered HTTP {status}", field="audio_url")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_large(max_bytes)


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


def fetch_s3(settings: Settings, url: str, dest: Path, progress: Progress | None = None,
             deadline_s: float | None = None) -> Fetched:
    """Blocking (boto3): runs on a worker thread, within ``deadline_s`` (default: the whole
    ``outbound.fetch_timeout_s``)."""
    bucket, key = s3_checked(settings, url)
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError

    out = settings.outbound
    client = s3_client(settings.storage.s3_endpoint_url, Config(
        connect_timeout=out.connect_timeout_s, read_timeout=min(60.0, out.fetch_timeout_s),
        retries={"max_attempts": 2}))
    deadline = time.monotonic() + (out.fetch_timeout_s if deadline_s is None else deadline_s)
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
