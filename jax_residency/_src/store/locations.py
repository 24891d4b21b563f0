"""Where a store lives: a local directory or a kvstore URL (`locate`), and the kvstore
specs of its OCDBT database and of an S3-compatible endpoint."""

from __future__ import annotations

import dataclasses
import os
import reprlib
import urllib.parse
from typing import Any

from jax_residency._src import errors
from jax_residency._src.store.read_options import ReadOptions

#: OCDBT settings for writing, as Orbax uses them.
#: Values up to this size are stored inside the OCDBT index, not in data files.
OCDBT_INLINE_BYTES = 1024
OCDBT_WRITE_CONFIG = {
  "max_inline_value_bytes": OCDBT_INLINE_BYTES,
  "max_decoded_node_bytes": 100_000_000,
  "manifest_kind": "single",
}


@dataclasses.dataclass(frozen=True)
class Location:
  """Where a store lives: a local directory or a TensorStore kvstore URL."""

  path: str  # as the caller gave it, for messages
  base: Any  # TensorStore kvstore spec of the directory (ends with "/")
  local: str | None  # absolute directory for local paths, else None
  reads: ReadOptions = ReadOptions()  # retries and time-out of its reads


def locate(path: str | os.PathLike[str], reads: ReadOptions | None = None) -> Location:
  """Resolves a local path (a `str` or `os.PathLike`), `file://` URL or other
  kvstore URL (`memory://`, `gs://`...), to be read with ``reads`` (default
  `ReadOptions()`)."""
  reads = ReadOptions() if reads is None else reads
  if not isinstance(reads, ReadOptions):
    raise errors.StoreError(
      f"read_options must be a jax_residency.ReadOptions; got {reprlib.repr(reads)} "
      f"({type(reads).__name__}). Pass e.g. read_options=jr.ReadOptions(retries=4)."
    )
  if isinstance(path, os.PathLike):
    path = os.fspath(path)
  if not isinstance(path, str) or not path:
    raise errors.StoreError(
      f"A store path must be a non-empty str or os.PathLike; got path={reprlib.repr(path)} "
      f"({type(path).__name__}). Pass a directory or a kvstore URL such as 'memory://name'."
    )
  if path.startswith("s3://") and s3_endpoint() is not None:
    return Location(path, s3_spec(path), None, reads)
  if "://" in path and not path.startswith("file://"):
    return Location(path, path if path.endswith("/") else path + "/", None, reads)
  local = urllib.parse.unquote(path[len("file://") :]) if path.startswith("file://") else path
  local = os.path.abspath(os.path.expanduser(local))
  return Location(path, {"driver": "file", "path": local + "/"}, local, reads)


#: Environment variables that name an S3-compatible endpoint (MinIO, Ceph, R2, a local
#: test server), first found first: the AWS SDKs' own. TensorStore's ``s3://`` URLs
#: ignore them and go to AWS, so `locate` turns such a URL into a spec with the endpoint.
S3_ENDPOINT_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")


def s3_endpoint() -> str | None:
  """The S3-compatible endpoint the environment names (`S3_ENDPOINT_ENV`), or None."""
  return next((os.environ[k] for k in S3_ENDPOINT_ENV if os.environ.get(k)), None)


def s3_spec(url: str) -> dict[str, Any]:
  """The TensorStore kvstore spec of ``s3://bucket/key`` at the environment's endpoint:
  its region from ``AWS_REGION`` / ``AWS_DEFAULT_REGION``, and its credentials from
  ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` where those are set (else the AWS
  default chain: profile files, instance metadata).

  Example:
    >>> import os
    >>> os.environ["AWS_ENDPOINT_URL_S3"] = "http://127.0.0.1:9000"
    >>> spec = s3_spec("s3://models/gpt/store")
    >>> spec["bucket"], spec["path"], spec["endpoint"]
    ('models', 'gpt/store/', 'http://127.0.0.1:9000')
    >>> del os.environ["AWS_ENDPOINT_URL_S3"]
  """
  bucket, _, key = url[len("s3://") :].partition("/")
  if not bucket:
    raise errors.StoreError(f"{url}: an s3:// store needs a bucket, as in s3://BUCKET/PATH.")
  spec: dict[str, Any] = {
    "driver": "s3",
    "bucket": bucket,
    "path": key if not key or key.endswith("/") else key + "/",
    "endpoint": s3_endpoint(),
  }
  region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
  if region:
    spec["aws_region"] = region
  if os.environ.get("AWS_ACCESS_KEY_ID"):
    spec["aws_credentials"] = {"type": "environment"}
  return spec


def ocdbt_spec(loc: Location, *, write: bool = False) -> dict[str, Any]:
  """The kvstore spec of the OCDBT database at ``loc`` (its index nodes use the
  context's ``cache_pool#ocdbt``); ``write`` adds Orbax's write settings."""
  spec: dict[str, Any] = {"driver": "ocdbt", "base": loc.base, "cache_pool": "cache_pool#ocdbt"}
  if write:
    spec.update(config=dict(OCDBT_WRITE_CONFIG), assume_config=True)
  return spec
