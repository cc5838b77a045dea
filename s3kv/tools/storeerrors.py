"""One wording for store errors, whichever command met them (``s3kv demo``, ``ls``, ``stats``,
``verify``, ``gc``, ``bench``).

The stores raise :class:`~s3kv.store.base.StoreError` classes whose messages carry the client's
own text (obstore's ``Debug source: Generic {...}``, an S3 XML error body, botocore's retry
notes): right for a log line an engineer greps, unreadable as the one line a command prints.
:func:`describe` turns such an error into what went wrong and what to check, from the error's
class and the S3 error code or transport failure found along its ``__cause__`` chain; an error
it does not recognise keeps its own first sentence, without the client's debug dump.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from typing import Any

from ..store.base import (
    BucketNotFound,
    DeadlineExceeded,
    PermissionDenied,
    StoreConfigError,
    StoreError,
    TransientError,
)

#: What each kind of user must be granted on the prefix (docs/operations.md, infra/terraform).
GRANTS = {
    "engine": "engines need s3:GetObject, s3:PutObject, s3:AbortMultipartUpload and s3:ListBucket on the "
    "prefix (no delete)",
    "operator": "s3kv ls/stats/verify need s3:ListBucket and s3:GetObject on the prefix, gc also s3:DeleteObject",
}

_CODE = re.compile(r"<Code>(\w+)</Code>|\b(SignatureDoesNotMatch|InvalidAccessKeyId|ExpiredToken|InvalidToken|"
                   r"AccessDenied|AllAccessDisabled|AccountProblem|NoSuchBucket|SlowDown|ServiceUnavailable|"
                   r"InternalError|RequestTimeTooSkewed)\b")
_HTTP = re.compile(r"status code: (\d{3})|\(HTTP (\d{3})\)|\b(\d{3}) (?:[A-Z][A-Za-z ]+):")
#: Transport failures that mean nobody answered at the endpoint (obstore's and botocore's words).
_NO_ANSWER = re.compile(r"error sending request|Connection refused|connect(?:ion)? (?:error|timed out)|"
                        r"Could not connect|dns error|failed to lookup address|Name or service not known|"
                        r"EndpointConnectionError|ConnectTimeoutError", re.I)
_NO_CREDENTIALS = re.compile(r"no AWS credentials found|Unable to locate credentials|NoCredentialsError|"
                             r"lacked valid authentication credentials", re.I)
#: Where a client's own dump starts: everything after it is for debuggers, not for users.
_DUMP = re.compile(r"\s*(?:Debug source:|<\?xml|\(object '|; last error:).*", re.S)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or (None if cur.__suppress_context__ else cur.__context__)


def _code(text: str) -> str:
    m = _CODE.search(text)
    return (m.group(1) or m.group(2)) if m else ""


def _http(text: str) -> int:
    m = _HTTP.search(text)
    return int(next(g for g in m.groups() if g)) if m else 0


def _endpoint(store: Any) -> str:
    """``http://host:port (set by $AWS_ENDPOINT_URL_S3)`` for an S3 store; "" for other stores."""
    url = getattr(store, "endpoint_url", None)
    if not url:
        return ""
    inner = getattr(store, "_boto", store)  # the obstore client resolves its endpoint through boto3's
    source = getattr(inner, "_endpoint_source", None)
    if callable(source):
        return f"{url} (endpoint from {source()})"
    var = next((v for v in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL") if os.environ.get(v)), None)
    return f"{url} (endpoint from ${var})" if var else url


def _first_sentence(exc: BaseException) -> str:
    text = _DUMP.sub("", str(exc)).strip()
    text = text.splitlines()[0] if text else type(exc).__name__
    return text if len(text) <= 240 else text[:237] + "..."


def describe(exc: StoreError, url: str = "", store: Any = None, role: str = "operator") -> str:
    """One line: ``URL: what went wrong; what to check``. ``store`` (when known) names the S3
    endpoint; ``role`` picks the permissions an access-denied answer points at."""
    chain = list(_chain(exc))
    text = " ".join(str(e) for e in chain)
    code = _code(text)
    endpoint = _endpoint(store)
    at = f" at {endpoint}" if endpoint else ""
    where = f"{url}: " if url else ""
    bucket = getattr(store, "bucket", None)

    if isinstance(exc, BucketNotFound) or code == "NoSuchBucket":
        name = f"bucket {bucket!r}" if bucket else "the bucket"
        return f"{where}{name} does not exist{at}; create it, or fix the bucket name in the URL"
    if _NO_CREDENTIALS.search(text) and not code:
        return (f"{where}no AWS credentials found; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
                "AWS_PROFILE, or run with a role (instance profile, IRSA)")
    if isinstance(exc, PermissionDenied) or code in ("AccessDenied", "AllAccessDisabled", "AccountProblem"):
        the_store = f"the store{at}"
        if code == "SignatureDoesNotMatch":
            why = f"{the_store} rejected the secret key (SignatureDoesNotMatch); check AWS_SECRET_ACCESS_KEY"
        elif code == "InvalidAccessKeyId":
            why = f"{the_store} does not know this access key (InvalidAccessKeyId); check AWS_ACCESS_KEY_ID / AWS_PROFILE"
        elif code in ("ExpiredToken", "InvalidToken"):
            why = f"{the_store} rejected the session credentials ({code}); refresh them (aws sso login, a new role session)"
        elif code == "RequestTimeTooSkewed":
            why = f"{the_store} rejected the request's time (RequestTimeTooSkewed); set this host's clock right"
        else:
            why = f"{the_store} denied access{f' ({code})' if code else ''}; {GRANTS.get(role, GRANTS['operator'])}"
        return f"{where}{why}"
    if isinstance(exc, (DeadlineExceeded, TransientError, StoreConfigError)) and (
        _NO_ANSWER.search(text) and not _http(text)
    ):
        target = f"the S3 endpoint {endpoint}" if endpoint else "the store"
        return f"{where}cannot reach {target}; is it running, and is the address right?"
    if isinstance(exc, (DeadlineExceeded, TransientError)):
        status = _http(text)
        what = f"HTTP {status}{f' {code}' if code else ''}" if status else (code or _first_sentence(chain[-1]))
        target = f"the S3 endpoint {endpoint}" if endpoint else "the store"
        return f"{where}{target} keeps failing ({what}); try again later, or raise S3KV_RETRY_DEADLINE_S"
    return f"{where}{_first_sentence(exc)}"
