"""An object store that answers no connection, said as what to check: its endpoint and the variable that sets it
(botocore's own account is a URL with a query and a traceback per retry). Nothing here imports botocore or the
rest of Shardline: every task's error boundary (`shardline.core.secrets.redacted_errors`) uses it."""

from __future__ import annotations

import os


def s3_endpoint(named: bool = False) -> str:
    """The S3 endpoint s3fs talks to (AWS's own when no variable sets one); `named`: with the variable that sets it."""
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "FSSPEC_S3_ENDPOINT_URL"):
        if os.environ.get(name):
            return f"{os.environ[name]} ({name})" if named else os.environ[name]
    return "AWS's default S3 endpoint"


class StorageUnreachable(ConnectionError):
    """The object store's endpoint refused or never answered the connection (after botocore's own retries): an
    infrastructure failure (retried), said naming the endpoint and the variable that sets it."""


class StorageRefused(PermissionError):
    """The object store answered and refused these credentials, or none were found: said naming what to set."""


# botocore's errors for a connection never made, or made and never answered (by name: nothing here imports botocore)
NO_CONNECTION = ("EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError")


def unreachable(e: BaseException) -> StorageUnreachable | None:
    """`e`, or an error it was raised from, as a StorageUnreachable when it is botocore's account of an object
    store it could not connect to; else None."""
    seen = e
    while seen is not None and type(seen).__name__ not in NO_CONNECTION:
        seen = seen.__cause__ or seen.__context__
    if seen is None or isinstance(e, StorageUnreachable):
        return None
    if type(seen).__name__ == "ReadTimeoutError":
        return StorageUnreachable(
            f"the object store at {s3_endpoint(named=True)} took the connection and did not answer any attempt in "
            "SHARDLINE_STORE_READ_SECONDS: is it overloaded or stalled? `shardline doctor CONFIG` checks it"
        )
    return StorageUnreachable(
        f"cannot connect to the object store at {s3_endpoint(named=True)}: is the server up and its address right? "
        "AWS_ENDPOINT_URL names an S3-compatible store (MinIO, ...); unset it for AWS's own. "
        "`shardline doctor CONFIG` checks the connection"
    )
