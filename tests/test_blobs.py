"""Upload storage any replica can read (app/jobs/blobs.py).

The local folder is what tests/test_postgres.py shares between two processes. :class:`S3Blobs`
runs through real boto3 against moto's S3 server (``moto[server]``, an S3 API over HTTP on a
local port), and below behind a whole service: one
whose blob store is S3 and which fetches ``s3://`` audio_url objects.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app.config import StorageSettings
from app.jobs.blobs import LocalBlobs, S3Blobs, make_blobs
from app.net.s3 import s3_client
from loadtest.lib.corpus import Clip
from tests.conftest import COLD, Server, free_port
from tests.wer import wer


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


# ---- S3: real boto3 against moto's S3 server ----------------------------------------------------
AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    """moto's S3 API on a local port (``ThreadedMotoServer``): boto3 speaks real HTTP to it."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in AWS_ENV.items():
        monkeypatch.setenv(k, v)


def bucket(endpoint: str, name: str) -> Any:
    client = s3_client(endpoint)
    client.create_bucket(Bucket=name)
    return client


def test_s3_round_trip(tmp_path: Path, s3_endpoint: str, aws: None) -> None:
    s3 = bucket(s3_endpoint, "round-trip")
    blobs = S3Blobs("s3://round-trip/bs/uploads/", tmp_path / "spool", endpoint_url=s3_endpoint)
    spooled = blobs.spool_dir / "job3"
    spooled.write_bytes(b"audio")
    key = blobs.key(spooled)
    blobs.put(key, spooled)
    assert not spooled.exists()  # the bucket holds it; the local spool was only staging
    assert s3.get_object(Bucket="round-trip", Key="bs/uploads/job3")["Body"].read() == b"audio"
    local = blobs.fetch(key)
    assert local.read_bytes() == b"audio"
    blobs.release(local)
    assert not local.exists()
    # The orphan sweep: bucket keys by age (S3's LastModified), local leftovers removed.
    (blobs.spool_dir / "crashed-mid-upload").write_bytes(b"x")
    past = time.time() - 1000
    os.utime(blobs.spool_dir / "crashed-mid-upload", (past, past))
    assert blobs.stale(time.time() + 10) == ["job3"] and blobs.stale(time.time() - 100) == []
    assert not (blobs.spool_dir / "crashed-mid-upload").exists()
    blobs.delete(key)
    blobs.delete(key)  # missing is fine
    assert s3.list_objects_v2(Bucket="round-trip").get("KeyCount", 0) == 0


def test_s3_prefix_pages_and_missing_objects(tmp_path: Path, s3_endpoint: str, aws: None) -> None:
    s3 = bucket(s3_endpoint, "many")
    for k in range(1005):  # more than one list page (1000 keys)
        s3.put_object(Bucket="many", Key=f"p/{k:04d}", Body=b"")
    s3.put_object(Bucket="many", Key="elsewhere/x", Body=b"")
    blobs = S3Blobs("s3://many/p", tmp_path / "spool", endpoint_url=s3_endpoint)
    stale = blobs.stale(time.time() + 10)
    assert len(stale) == 1005 and "0000" in stale and "x" not in stale
    with pytest.raises(Exception, match=r"404|Not Found|NoSuchKey"):
        blobs.fetch("never-uploaded")


# ---- a service on S3 ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def on_s3(tmp_path_factory: pytest.TempPathFactory, s3_endpoint: str) -> Iterator[Server]:
    os.environ.update(AWS_ENV)  # for this test process's own boto3 client
    for name in ("blobs", "media"):
        bucket(s3_endpoint, name)
    srv = Server(tmp_path_factory.mktemp("on-s3"), env={
        **AWS_ENV, **COLD, "BATCHSCRIBE_STORAGE__BLOB_URL": "s3://blobs/up",
        "BATCHSCRIBE_STORAGE__S3_ENDPOINT_URL": s3_endpoint,
        "BATCHSCRIBE_OUTBOUND__S3_BUCKETS": '["media/clips"]',
    }).start()
    yield srv
    srv.terminate()


@pytest.mark.model
def test_a_service_on_an_s3_blob_store(on_s3: Server, s3_endpoint: str, clips: list[Clip]) -> None:
    clip = next(c for c in clips if c.set == "ljspeech" and c.duration_s > 3)
    s3 = s3_client(s3_endpoint)
    with on_s3.client() as c, clip.path.open("rb") as f:
        r = c.post("/transcribe", params={"wait": "true"}, data={"language": "en"},
                   files={"file": (clip.path.name, f)})
    assert r.status_code == 200 and r.json()["status"] == "done", r.text
    assert wer([clip.reference], [r.json()["result"]["text"]]) < 0.3
    # The upload went through the bucket and is deleted once the job has ended: right after its
    # end is told (app/jobs/runner.py), so the DELETE may land just after the reply (CI saw it).
    deadline = time.monotonic() + 10
    while s3.list_objects_v2(Bucket="blobs", Prefix="up/").get("KeyCount", 0):
        assert time.monotonic() < deadline, "the upload stayed in the bucket"
        time.sleep(0.1)


@pytest.mark.model
def test_s3_audio_url(on_s3: Server, s3_endpoint: str, clips: list[Clip]) -> None:
    clip = next(c for c in clips if c.set == "ljspeech" and c.duration_s > 3)
    s3 = s3_client(s3_endpoint)
    s3.put_object(Bucket="media", Key="clips/talk.flac", Body=clip.path.read_bytes())
    s3.put_object(Bucket="media", Key="private/talk.flac", Body=clip.path.read_bytes())
    s3.put_object(Bucket="blobs", Key="up/someone-elses-upload", Body=clip.path.read_bytes())
    with on_s3.client() as c:
        r = c.post("/transcribe", params={"wait": "true"},
                   json={"audio_url": "s3://media/clips/talk.flac", "language": "en"})
        assert r.status_code == 200 and r.json()["status"] == "done", r.text
        job = r.json()
        assert job["options"]["audio_url"] == "s3://media/clips/talk.flac"
        assert job["filename"] == "talk.flac"
        assert wer([clip.reference], [job["result"]["text"]]) < 0.3
        # Not listed, the blob store's own uploads (other tenants' audio), or missing: all 400,
        # and "missing" reads like "not yours".
        for url in ("s3://media/private/talk.flac", "s3://blobs/up/someone-elses-upload",
                    "s3://other-bucket/x.flac", "s3://media", "s3://", "s3:///x"):
            r = c.post("/transcribe", json={"audio_url": url})
            assert r.status_code == 400 and r.json()["error"]["field"] == "audio_url", (url, r.text)
        # A listed bucket's missing object: found when the job's download runs (answered at once).
        r = c.post("/transcribe", params={"wait": "true"},
                   json={"audio_url": "s3://media/clips/missing.flac"})
        err = r.json()["error"]
        assert r.json()["status"] == "failed" and err["field"] == "audio_url", r.text
        assert err["type"] == "bad_request" and "no such object" in err["message"]
