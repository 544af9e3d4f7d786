"""S3: the client (boto3, optional: imported only when an s3:// location is configured or
asked for) and ``s3://bucket/key`` URLs. Used by the S3 blob store (app/jobs/blobs.py) and by
``audio_url=s3://...`` (app/net/fetch.py)."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlparse


def s3_location(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` -> ("bucket", "a/b"); ValueError for anything else."""
    u = urlparse(url)
    if u.scheme != "s3" or not u.netloc:
        raise ValueError(f"not an s3://bucket/key URL: {url!r}")
    return u.netloc, u.path.lstrip("/")


def s3_client(endpoint_url: str = "", config: Any = None) -> Any:
    """A boto3 S3 client on the usual AWS_* credentials (boto3 is imported only here)."""
    try:
        import boto3
    except ImportError as exc:
        raise RuntimeError("s3:// storage needs boto3 (pip install boto3)") from exc
    return boto3.client("s3", endpoint_url=endpoint_url or None, config=config)
