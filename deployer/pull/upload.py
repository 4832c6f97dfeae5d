"""Copy a published channel to its destination: a plain directory, or S3 (`s3://bucket/prefix`).

Order matters to pollers reading while we write: target files first, then the versioned metadata,
and `metadata/timestamp.json` last, since it is what makes a new release visible. Files that are
already there with the same size are skipped under targets/ (content-addressed names: same name,
same bytes); metadata is small and always written, so a re-created channel cannot leave stale
files. boto3 is an optional dependency, imported only for s3:// destinations.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from deployer.errors import TransportError

__all__ = ["TIMESTAMP", "upload", "upload_order"]

TIMESTAMP = "metadata/timestamp.json"
# Mutable or short-lived files must not be cached by a CDN for long; everything else is immutable.
_CACHE_SHORT = "max-age=60"
_CACHE_FOREVER = "public, max-age=31536000, immutable"


def upload_order(local: Path) -> list[str]:
    """Relative paths under `local`: targets, then versioned metadata, then timestamp.json."""
    files = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
    files = [f for f in files if not f.endswith(".tmp")]
    targets = [f for f in files if f.startswith("targets/")]
    metadata = [f for f in files if f.startswith("metadata/") and f != TIMESTAMP]
    return targets + metadata + ([TIMESTAMP] if TIMESTAMP in files else [])


def upload(local: Path, destination: str) -> int:
    """Copy the channel at `local` to `destination`; return how many files were written."""
    if destination.startswith("s3://"):
        return _upload_s3(local, destination)
    if "://" in destination:
        raise TransportError(
            f"{destination}: only a directory or an s3://bucket/prefix destination is supported",
            hint="publish to a directory your web server serves, or to an S3-compatible bucket",
        )
    return _upload_dir(local, Path(destination))


def _upload_dir(local: Path, dest: Path) -> int:
    written = 0
    try:
        for rel in upload_order(local):
            src, out = local / rel, dest / rel
            if _is_target(rel) and out.is_file() and out.stat().st_size == src.stat().st_size:
                continue
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_name(out.name + ".tmp")
            shutil.copyfile(src, tmp)
            tmp.chmod(0o644)  # the web server's user reads it
            tmp.replace(out)
            written += 1
    except OSError as exc:
        raise TransportError(
            f"cannot write the channel to {dest}: {exc.strerror or exc} ({exc.filename})",
            hint="check that the directory exists and is writable",
        ) from exc
    return written


def _upload_s3(local: Path, destination: str) -> int:
    try:
        import boto3
        from botocore.exceptions import BotoCoreError, ClientError
    except ImportError as exc:
        raise TransportError(
            "s3:// destinations need boto3, which is not installed",
            hint="pip install 'sits-deployer[s3]' (or boto3)",
        ) from exc
    bucket, _, prefix = destination.removeprefix("s3://").partition("/")
    prefix = prefix.strip("/")
    client = boto3.client("s3", endpoint_url=os.environ.get("SITS_S3_ENDPOINT_URL") or None)
    key_of = lambda rel: f"{prefix}/{rel}" if prefix else rel  # noqa: E731
    try:
        existing = _s3_sizes(client, bucket, prefix)
        written = 0
        for rel in upload_order(local):
            src = local / rel
            if _is_target(rel) and existing.get(key_of(rel)) == src.stat().st_size:
                continue
            cache = _CACHE_SHORT if rel == TIMESTAMP else _CACHE_FOREVER
            client.upload_file(str(src), bucket, key_of(rel), ExtraArgs={"CacheControl": cache})
            written += 1
        return written
    except (BotoCoreError, ClientError) as exc:
        raise TransportError(
            f"uploading to {destination} failed: {exc}",
            hint="check the bucket name, the credentials (AWS_* variables or ~/.aws) and their "
            "s3:PutObject / s3:ListBucket permissions",
        ) from exc


def _is_target(rel: str) -> bool:
    return rel.startswith("targets/")


def _s3_sizes(client: object, bucket: str, prefix: str) -> dict[str, int]:
    sizes: dict[str, int] = {}
    paginator = client.get_paginator("list_objects_v2")  # type: ignore[attr-defined]
    for page in paginator.paginate(Bucket=bucket, Prefix=f"{prefix}/" if prefix else ""):
        for obj in page.get("Contents", []):
            sizes[obj["Key"]] = obj["Size"]
    return sizes
