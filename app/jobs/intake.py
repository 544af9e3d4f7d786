"""Taking an upload in: spool, probe, admit, commit; one owner. An ``audio_url`` is checked and
committed as a ``fetching`` job at once, its download part of the job (app/jobs/fetching.py).

The router hands the request's audio over once (:class:`app.jobs.door.Upload`). From then on
the file is the core's: written under a random job id in the blob store's spool folder, probed
(a 2-hour upload is refused in milliseconds), admitted against the backlog bounds, put in the
blob store and committed as a queued job row, in that order. Whatever refuses it on the way,
the spool file is removed here, and so is the stored upload of a request that lost an
Idempotency-Key race (see below).

``Idempotency-Key``: the job row holds ``sha256(owner NUL key)`` under a unique index
(migration 0004). The owner is part of the digest, so tenants' keys never meet, and the keyless
tenant (owner NULL, which a unique index over (owner, key) would not constrain: NULLs are
distinct) is covered by the same index. The row is inserted with its digest in one statement,
so a job and its key exist together or not at all. Two POSTs with one key at once both miss
the lookup and spool their upload; the second INSERT violates the unique index, and that
request answers with the first one's job, its own upload dropped.
"""

from __future__ import annotations

import hashlib
import secrets
import time
import unicodedata
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio.to_thread
import sqlalchemy as sa

from app import audio
from app.config import Settings
from app.errors import InvalidAudio
from app.jobs.admission import Admission
from app.jobs.blobs import BlobStore, drop_upload
from app.jobs.door import Upload
from app.jobs.fetching import Fetches
from app.jobs.store import JobRow, JobStore
from app.jobs.webhooks import check_callback_url
from app.net.outbound import OutboundGuard
from app.windows import JobOptions

# JobRunner.submit: (job id, spooled upload, file name, options, audio s, owner, callback_url,
# idempotency digest): the upload into the blob store, then the queued job's row.
Commit = Callable[[str, Path, str | None, JobOptions, float, str | None, str | None, str | None],
                  Awaitable[None]]
KEPT_FORMAT_CHARS = frozenset("\u200c\u200d")  # zero-width (non-)joiners: parts of emoji and scripts


def new_job_id() -> str:
    return secrets.token_urlsafe(18)  # 144 random bits: ids cannot be guessed or enumerated


def clean_name(name: str | None) -> str | None:
    """A client's file name as a display name: control characters (NUL gave a 500 on
    PostgreSQL), unpaired surrogates (not encodable) and invisible format characters (e.g.
    right-to-left overrides, which disguise a name) removed; at most 255 characters."""
    if not name:
        return None
    kept = "".join(c for c in name if unicodedata.category(c) not in ("Cc", "Cs", "Cf")
                   or c in KEPT_FORMAT_CHARS)
    return kept.strip()[:255] or None


def digest(owner: str | None, key: str) -> str:
    return hashlib.sha256(f"{owner or ''}\0{key}".encode()).hexdigest()


class Intake:
    """Uploads in, committed as queued jobs (``commit``: the job runner's submit)."""

    def __init__(self, settings: Settings, store: JobStore, blobs: BlobStore,
                 outbound: OutboundGuard, admission: Admission, commit: Commit,
                 fetches: Fetches) -> None:
        self.settings = settings
        self.fetches = fetches
        self._store = store
        self._blobs = blobs
        self._outbound = outbound
        self._admission = admission
        self._insert = commit

    async def find(self, owner: str | None, key: str) -> JobRow | None:
        """The caller's job made under ``key`` within ``storage.idempotency_window_s``."""
        since = time.time() - self.settings.storage.idempotency_window_s
        row = await self._store.by_idempotency_key(digest(owner, key), since)
        return row if row is not None and row.owner == owner else None

    async def submit(self, up: Upload) -> str:
        """The job's id: the new job's, or the first job's when another request with the same
        Idempotency-Key committed first."""
        s = self.settings
        # Both URL checks come before any byte is spooled or fetched.
        callback_url = await check_callback_url(s.webhooks, self._outbound, up.callback_url)
        if up.write is None:
            return await self._submit_fetch(up, callback_url)
        job_id = new_job_id()
        # The client's file name is display-only; the spool path is our random id.
        dest = self._blobs.spool_dir / job_id
        options = up.options
        write = up.write
        assert write is not None
        try:
            size = await anyio.to_thread.run_sync(write, dest, s.limits.max_upload_bytes)
            filename = clean_name(up.filename)
            if size == 0:
                raise InvalidAudio("the uploaded file is empty")
            info = await anyio.to_thread.run_sync(audio.probe, dest, s.limits.max_audio_s)
            if up.check is not None:
                up.check(info.duration_s)
            async with self._admission.admitted(info.duration_s, up.owner):  # 429 past the bounds
                first = await self._commit(job_id, dest, filename, options, info.duration_s,
                                           up, callback_url)
        except BaseException:
            dest.unlink(missing_ok=True)
            raise
        if first is not None:  # a concurrent request with this key won: this upload is not needed
            await drop_upload(self._blobs, self._blobs.key(dest))
            dest.unlink(missing_ok=True)
            return first
        return job_id

    async def _submit_fetch(self, up: Upload, callback_url: str | None) -> str:
        """An ``audio_url`` job: checked, committed as ``fetching`` and answered at once; the
        download runs as part of the job, under the key's transfer hold."""
        url, hold = await self.fetches.check(up)
        try:
            job_id = new_job_id()
            dest = self._blobs.spool_dir / job_id
            options, name = Fetches.options_of(up, url)
            key = up.idempotency_key
            hashed = digest(up.owner, key) if key is not None else None
            try:
                await self._store.insert(
                    id=job_id, owner=up.owner, status="fetching", created_at=time.time(),
                    filename=clean_name(name), upload_path=self._blobs.key(dest),
                    options=options.to_dict(), audio_seconds=0.0, windows_done=0, attempts=0,
                    callback_url=callback_url, idempotency_key=hashed)
            except sa.exc.IntegrityError:
                first = await self.find(up.owner, key) if key is not None else None
                if first is None:
                    raise
                hold.release()
                return first.id
        except BaseException:
            hold.release()
            raise
        self.fetches.start(job_id, up, url, dest, hold)
        return job_id

    async def _commit(self, job_id: str, dest: Path, filename: str | None, options: JobOptions,
                      audio_s: float, up: Upload, callback_url: str | None) -> str | None:
        """The job's INSERT: None when it committed; the first job's id when a request with
        the same key committed first (the unique index refused this one)."""
        key = up.idempotency_key
        hashed = digest(up.owner, key) if key is not None else None
        try:
            await self._insert(job_id, dest, filename, options, audio_s, up.owner, callback_url,
                               hashed)
        except sa.exc.IntegrityError:
            first = await self.find(up.owner, key) if key is not None else None
            if first is None:  # not our index: a real error
                raise
            return first.id
        return None
