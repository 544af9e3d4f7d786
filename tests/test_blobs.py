"""Upload storage any replica can read (app/jobs/blobs.py).

The local folder is what tests/test_postgres.py shares between two processes. No S3 server is
available here (Debian has no MinIO package), so :class:`S3Blobs` runs against an in-memory
stand-in for the boto3 client: it checks our side of the calls, not an S3 implementation.
"""

from __future__ import annotations

import datetime as dt
import os
import time
from pathlib import Path
from typing import Any

import pytest

from app.config import StorageSettings
from app.jobs.blobs import LocalBlobs, S3Blobs, make_blobs


def test_local_keys_are_relative_and_old_rows_still_resolve(tmp_path: Path) -> None:
    blobs = LocalBlobs(tmp_path / "uploads")
    spooled = blobs.spool_dir / "job1"
    spooled.write_bytes(b"RIFF")
    key = blobs.key(spooled)
    assert key == "job1"  # what the row stores: valid on every replica that mounts the folder
    blobs.put(key, spooled)  # already in place: nothing to copy
    assert blobs.fetch(key).read_bytes() == b"RIFF"
    legacy = tmp_path / "elsewhere" / "old"
    legacy.parent.mkdir()
    legacy.write_bytes(b"old")
    assert blobs.fetch(str(legacy)).read_bytes() == b"old"  # rows written before keys existed
    blobs.delete(key)
    blobs.delete(key)  # twice is fine: whoever ends a job deletes its upload
    assert not spooled.exists()


def test_local_put_moves_uploads_spooled_elsewhere(tmp_path: Path) -> None:
    blobs = LocalBlobs(tmp_path / "shared")
    outside = tmp_path / "spool" / "job2"
    outside.parent.mkdir()
    outside.write_bytes(b"x")
    key = blobs.key(outside)
    blobs.put(key, outside)
    assert not outside.exists() and (tmp_path / "shared" / "job2").read_bytes() == b"x"


def test_local_stale_lists_only_old_files(tmp_path: Path) -> None:
    blobs = LocalBlobs(tmp_path)
    (tmp_path / "old").write_bytes(b"")
    (tmp_path / "new").write_bytes(b"")
    past = time.time() - 1000
    os.utime(tmp_path / "old", (past, past))
    assert blobs.stale(time.time() - 500) == ["old"]


def test_make_blobs_choices(tmp_path: Path) -> None:
    default = make_blobs(StorageSettings(data_dir=tmp_path))  # type: ignore[call-arg]
    assert isinstance(default, LocalBlobs) and default.root == tmp_path / "uploads"
    folder = make_blobs(StorageSettings(data_dir=tmp_path, blob_url=f"file://{tmp_path}/b"))  # type: ignore[call-arg]
    assert isinstance(folder, LocalBlobs) and folder.root == tmp_path / "b"
    with pytest.raises(ValueError, match="s3://bucket"):
        S3Blobs("s3://", tmp_path, client=object())


class FakeS3:
    """Just the boto3 client calls S3Blobs makes, on a dict."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], tuple[bytes, dt.datetime]] = {}

    def upload_file(self, filename: str, bucket: str, key: str) -> None:
        self.objects[bucket, key] = (Path(filename).read_bytes(), dt.datetime.now(dt.UTC))

    def download_file(self, bucket: str, key: str, filename: str) -> None:
        Path(filename).write_bytes(self.objects[bucket, key][0])

    def delete_object(self, Bucket: str, Key: str) -> None:  # boto3's argument names
        self.objects.pop((Bucket, Key), None)

    def get_paginator(self, name: str) -> Any:
        assert name == "list_objects_v2"
        outer = self

        class Pages:
            def paginate(self, Bucket: str, Prefix: str) -> list[dict[str, Any]]:
                return [{"Contents": [{"Key": k, "LastModified": t}
                                      for (b, k), (_, t) in outer.objects.items()
                                      if b == Bucket and k.startswith(Prefix)]}]
        return Pages()


def test_s3_round_trip_with_a_stand_in_client(tmp_path: Path) -> None:
    s3 = FakeS3()
    blobs = S3Blobs("s3://bucket/bs/uploads/", tmp_path / "spool", client=s3)
    spooled = blobs.spool_dir / "job3"
    spooled.write_bytes(b"audio")
    key = blobs.key(spooled)
    blobs.put(key, spooled)
    assert not spooled.exists()  # the bucket holds it; the local spool was only staging
    assert ("bucket", "bs/uploads/job3") in s3.objects
    local = blobs.fetch(key)
    assert local.read_bytes() == b"audio"
    blobs.release(local)
    assert not local.exists()
    assert blobs.stale(time.time() + 10) == ["job3"] and blobs.stale(time.time() - 10) == []
    blobs.delete(key)
    assert not s3.objects
