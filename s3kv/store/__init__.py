"""Object stores: one narrow interface (``base``) and its implementations and wrappers.

Heavy back ends (boto3, fsspec, moto) are imported by their own modules only, so importing
this package stays cheap; ``open_store(url)`` picks the right one.
"""

from .base import (
    BucketNotFound,
    Buffer,
    ByteRange,
    DeadlineExceeded,
    HeadBatch,
    IntegrityError,
    LocalFailure,
    NotFound,
    ObjectInfo,
    ObjectStore,
    PermissionDenied,
    StoreConfigError,
    StoreError,
    StoreWrapper,
    TransientError,
)
from .factory import open_store, parse_store_url
from .memory import MemoryStore
from .retrying import RetryingStore, RetryPolicy

__all__ = [
    "BucketNotFound",
    "Buffer",
    "ByteRange",
    "DeadlineExceeded",
    "HeadBatch",
    "IntegrityError",
    "LocalFailure",
    "MemoryStore",
    "NotFound",
    "ObjectInfo",
    "ObjectStore",
    "PermissionDenied",
    "RetryPolicy",
    "RetryingStore",
    "StoreConfigError",
    "StoreError",
    "StoreWrapper",
    "TransientError",
    "open_store",
    "parse_store_url",
]
