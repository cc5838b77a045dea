"""Errors a connector call may raise to the engine (everything else is a miss or a dropped save)."""

from __future__ import annotations

from collections.abc import Iterable


class S3KvError(Exception):
    """Base of s3kv's own errors."""


class LoadFailed(S3KvError):
    """A promised load could not be completed with verified bytes.

    The engine has no failed-load API, so the only safe outcome is to fail the
    requests involved with an error that names the object; loading anything
    unverified would be a wrong answer rather than a slow one.
    """

    def __init__(self, message: str, *, request_ids: Iterable[int], key: str | None = None):
        self.request_ids = tuple(sorted(set(request_ids)))
        self.key = key
        where = f" (object {key!r})" if key else ""
        super().__init__(f"s3kv load failed for request(s) {list(self.request_ids)}{where}: {message}")


class PlanMismatch(S3KvError):
    """The engine allocated a page the load plan cannot fill: a bug to fail loudly on."""


#: Why a promised load failed: the ``cause`` label of the parked-request metric. broken_promise:
#: the engine honoured a point no stored object serves (or the plan did not fit its pages);
#: missing / corrupt / unusable: what the object read said; timeout; store_error: anything else.
PARK_CAUSES = ("broken_promise", "missing", "corrupt", "unusable", "timeout", "store_error")
