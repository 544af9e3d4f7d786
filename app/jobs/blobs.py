"""Where uploaded audio lives between its 202 and the end of its job: readable by every replica.

A job row stores a *key*, never a host path, so whichever replica claims the job can find the
audio. Two implementations:

* :class:`LocalBlobs` (default): a folder, ``<data_dir>/uploads``. With several replicas it must
  be a shared volume (NFS, CephFS, a ReadWriteMany PVC). The upload is written there directly,
  so committing it costs nothing.
* :class:`S3Blobs`: S3-compatible object storage (``s3://bucket/prefix``; MinIO, Ceph RGW, R2...).
  Uploads are spooled to local disk, probed, then put in the bucket before the job row is
  committed; a replica downloads the object to a temporary file to decode it. Needs ``boto3``,
  which is optional and imported only when this backend is configured.

Every method blocks (disk or network): callers run them on a worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

from app.config import StorageSettings
from app.net.s3 import s3_client, s3_location

log = logging.getLogger(__name__)


class BlobStore(Protocol):
    spool_dir: Path  # uploads are written here first (local disk of this replica)

    def key(self, spooled: Path) -> str:
        """The key a spooled upload will be stored under (what the job row records)."""
        ...

    def put(self, key: str, spooled: Path) -> None:
        """Make the spooled file durable under ``key``, readable by any replica."""
        ...

    def fetch(self, key: str) -> Path:
        """A local file with the blob's bytes; hand it back to :meth:`release` when done."""
        ...

    def release(self, path: Path) -> None: ...

    def delete(self, key: str) -> None:
        """Remove the blob; missing is fine (a job's upload is deleted once, by whoever ends it)."""
        ...

    def stale(self, older_than: float) -> list[str]:
        """Keys last written before ``older_than`` (epoch s): candidates for the orphan sweep."""
        ...


class LocalBlobs:
    """A folder, shared by every replica that uses the same job database."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.spool_dir = root
        root.mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        # Rows written before keys existed hold an absolute path: still readable where it was.
        p = Path(key)
        return p if p.is_absolute() else self.root / key

    def key(self, spooled: Path) -> str:
        try:
            return spooled.relative_to(self.root).as_posix()
        except ValueError:
            return spooled.name  # spooled elsewhere: put() moves it under the root

    def put(self, key: str, spooled: Path) -> None:
        """Durable before the job row commits: the file's bytes were fsynced when it was
        written; here its directory entry is (after a move, the file again too), so a power
        loss cannot leave a committed job without its upload."""
        dest = self.path(key)
        if spooled.resolve() != dest.resolve():
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(spooled, dest)
            fsync_path(dest)
        fsync_path(dest.parent)

    def fetch(self, key: str) -> Path:
        return self.path(key)

    def release(self, path: Path) -> None:
        pass  # the blob itself, not a copy

    def delete(self, key: str) -> None:
        _unlink(self.path(key))

    def stale(self, older_than: float) -> list[str]:
        out = []
        for f in list(self.root.iterdir()) if self.root.is_dir() else []:
            try:
                if f.is_file() and f.stat().st_mtime < older_than:
                    out.append(f.name)
            except FileNotFoundError:  # deleted by a replica meanwhile
                continue
        return out


class S3Blobs:
    """S3-compatible object storage (tested against moto's S3 server, tests/test_blobs.py)."""

    def __init__(self, url: str, spool_dir: Path, endpoint_url: str = "",
                 client: Any | None = None) -> None:
        try:
            self.bucket, prefix = s3_location(url)
        except ValueError:
            raise ValueError(f"blob_url must look like s3://bucket/prefix, not {url!r}") from None
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.spool_dir = spool_dir
        self._fetch_dir = spool_dir / ".fetch"
        self._fetch_dir.mkdir(parents=True, exist_ok=True)
        self._s3 = client if client is not None else s3_client(endpoint_url)

    def key(self, spooled: Path) -> str:
        return spooled.name  # the job id: random, unique

    def put(self, key: str, spooled: Path) -> None:
        self._s3.upload_file(str(spooled), self.bucket, self.prefix + key)
        _unlink(spooled)  # the bucket has it now; the local spool is only a staging area

    def fetch(self, key: str) -> Path:
        # A replica-local temporary copy: decoding seeks, and ffmpeg wants a file anyway.
        dest = self._fetch_dir / f"{Path(key).name}.{time.monotonic_ns()}"
        self._s3.download_file(self.bucket, self.prefix + key, str(dest))
        return dest

    def release(self, path: Path) -> None:
        _unlink(path)

    def delete(self, key: str) -> None:
        self._s3.delete_object(Bucket=self.bucket, Key=self.prefix + key)

    def stale(self, older_than: float) -> list[str]:
        # Local leftovers (a crash mid-upload or mid-decode) are never referenced by a job row:
        # committed uploads are in the bucket. Remove them here; report only bucket keys.
        for f in [*self.spool_dir.glob("*"), *self._fetch_dir.glob("*")]:
            try:
                if f.is_file() and f.stat().st_mtime < older_than:
                    _unlink(f)
            except FileNotFoundError:
                continue
        out = []
        pages = self._s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket,
                                                                   Prefix=self.prefix)
        for page in pages:
            for obj in page.get("Contents", []):
                if obj["LastModified"].timestamp() < older_than:
                    out.append(obj["Key"][len(self.prefix):])
        return out


def make_blobs(storage: StorageSettings) -> BlobStore:
    url = storage.blob_url.strip()
    if url.startswith("s3://"):
        return S3Blobs(url, storage.data_dir / "uploads", storage.s3_endpoint_url)
    if url.startswith("file://"):
        url = urlparse(url).path
    return LocalBlobs(Path(url) if url else storage.data_dir / "uploads")


async def drop_upload(blobs: BlobStore, key: str) -> None:
    """Remove a job's upload, off the event loop; a failure is logged, never raised (the
    orphan sweep retries; a finished job must not fail for this)."""
    try:
        await asyncio.to_thread(blobs.delete, key)
    except Exception as exc:
        log.warning("cannot remove upload %s: %s", key, exc)


def fsync_path(path: Path) -> None:
    """fsync a file's bytes or a directory's entries."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("cannot remove %s: %s", path, exc)
