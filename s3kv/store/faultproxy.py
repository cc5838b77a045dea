"""Wire-level fault injection: an HTTP/1.1 reverse proxy in front of a real S3 server.

Unlike :mod:`s3kv.store.faults` (which raises store errors above the store interface), the
faults here are real bytes on a real socket, so boto3, urllib3 and the store's own retry and
length checks see exactly what a flaky network or a throttling S3 would show them::

    with EmbeddedS3("moto") as s3:
        with FaultProxy.for_url(s3.endpoint_url, WireFaultPlan(reset=0.1), seed=1) as px:
            store = S3Store(s3.bucket, endpoint_url=px.endpoint_url, ...)

Faults (at most one per request; the ``WireFaultPlan`` rates are exclusive and sum to <= 1):

* ``slowdown_503`` / ``error_500``: an S3 XML error (``SlowDown`` / ``InternalError``) answered
  by the proxy itself; upstream never sees the request.
* ``reset``: the client connection is closed with ``SO_LINGER 0`` (a real RST) - ``before``
  the request reaches upstream, ``after`` upstream executed it but before any answer byte (a
  lost answer: a PUT landed, the client does not know), or ``mid`` response (part of the head
  or body was sent).
* ``stall``: upstream executes the request, then the answer is held ``stall_s`` (meant to be
  longer than the client's read timeout); the hold ends early when the client hangs up.
* ``truncate``: the head is sent as upstream wrote it (full ``Content-Length``) with only part
  of the body, then a clean FIN. An answer without a body (HEAD, most PUTs) passes untouched
  and counts as ``truncate_skipped``, not as a fault.
* ``truncate_head``: only part of the response head (status line and headers), then a clean
  FIN. Nasty on purpose: ``http.client`` takes a header block ended by EOF as complete, so the
  client may see a 200 that lacks headers (``Content-Length``, ``ETag``) rather than an error.
* ``latency_s`` (+ uniform ``latency_jitter_s``): a delay before every request (not a fault).

Every request draws three numbers from ``random.Random(seed)`` in arrival order (fault, shape,
jitter), whatever the outcome, so a sequential client replays exactly; ``events()`` is the
sequence. ``set_down(True)`` simulates an outage: ``mode="refuse"`` closes the listening
socket (connection refused) and resets open connections, ``mode="503"`` answers every request
``503 ServiceUnavailable``.

Wire notes (boto3 1.44 over plain HTTP, ``request_checksum_calculation='when_required'``, as
:class:`~s3kv.store.s3.S3Store` sets it): every request with a body has a ``Content-Length``
(no chunked or ``aws-chunked`` bodies - over HTTP the payload is signed, so even default
checksums go in a header); PutObject and UploadPart send ``Expect: 100-continue`` and a
``bytes`` body goes out in the same ``send`` as the head; ``Host`` (with the proxy's port) is
signed, so it is forwarded untouched. Chunked bodies (either direction) are relayed verbatim.

Why this is one module: the proxy's HTTP parsing, forwarding and fault injection act on the same
connection state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import socket
import struct
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from email.utils import formatdate
from typing import Any, Literal
from urllib.parse import urlsplit

LOOPBACK = "127.0.0.1"
FAULTS = ("slowdown_503", "error_500", "reset", "stall", "truncate", "truncate_head")
_CHUNK = 256 * 1024
_MAX_LINE = 64 * 1024
_MAX_HEAD = 256 * 1024
_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"upgrade", b"te", b"expect"})


@dataclass(frozen=True)
class WireFaultPlan:
    """Per-request fault probabilities (exclusive, each in [0, 1], sum <= 1) and delays.

    ``ops``: HTTP methods faults apply to (None: all); latency applies to every request.
    ``max_faults``: stop injecting after this many faults under this plan (``set_plan`` resets).
    ``reset_when``: ``any`` spreads resets evenly over ``before`` / ``after`` / ``mid``.
    """

    slowdown_503: float = 0.0
    error_500: float = 0.0
    reset: float = 0.0
    stall: float = 0.0
    truncate: float = 0.0
    truncate_head: float = 0.0
    stall_s: float = 5.0
    latency_s: float = 0.0
    latency_jitter_s: float = 0.0
    ops: Collection[str] | None = None  # stored as a frozenset of upper-case methods
    max_faults: int | None = None
    reset_when: Literal["any", "before", "after", "mid"] = "any"

    def __post_init__(self) -> None:
        for name in FAULTS:
            p = getattr(self, name)
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"WireFaultPlan.{name} must be in [0, 1], got {p}")
        if sum(getattr(self, n) for n in FAULTS) > 1.0 + 1e-9:
            raise ValueError("WireFaultPlan fault rates are exclusive and must sum to <= 1")
        if min(self.stall_s, self.latency_s, self.latency_jitter_s) < 0:
            raise ValueError("WireFaultPlan delays must be >= 0")
        if self.max_faults is not None and self.max_faults < 0:
            raise ValueError("WireFaultPlan.max_faults must be >= 0")
        if self.reset_when not in ("any", "before", "after", "mid"):
            raise ValueError(
                f"WireFaultPlan.reset_when must be any|before|after|mid, got {self.reset_when!r}"
            )
        if self.ops is not None:
            if isinstance(self.ops, str):
                raise ValueError("WireFaultPlan.ops must be a collection of HTTP methods, not a string")
            object.__setattr__(self, "ops", frozenset(m.upper() for m in self.ops))


@dataclass(frozen=True)
class WireEvent:
    seq: int
    method: str
    path: str
    fault: str | None  # one of FAULTS, "down_503", "down_refused", or None


class _Eof(Exception):
    """The peer closed the connection."""


class _BadMessage(Exception):
    """Unparseable HTTP."""


class _UpstreamGone(Exception):
    """Sending to upstream failed."""


class _Cut(Exception):
    """The byte budget of a truncate / mid-response reset ran out."""


class _Reader:
    """Buffered reads off a socket (own class, not ``makefile``, so closing is never deferred)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = bytearray()

    def readline(self) -> bytes:
        """One line including its newline; b"" on a clean EOF before any byte."""
        while True:
            i = self.buf.find(b"\n")
            if i >= 0:
                line = bytes(self.buf[: i + 1])
                del self.buf[: i + 1]
                return line
            if len(self.buf) > _MAX_LINE:
                raise _BadMessage("line too long")
            data = self.sock.recv(_CHUNK)
            if not data:
                if self.buf:
                    raise _Eof("EOF mid-line")
                return b""
            self.buf += data

    def read_some(self, n: int) -> bytes:
        if self.buf:
            data = bytes(self.buf[:n])
            del self.buf[:n]
            return data
        data = self.sock.recv(min(n, _CHUNK))
        if not data:
            raise _Eof("EOF in body")
        return data


class _Head:
    """Start line and header lines of one message, raw bytes kept for forwarding."""

    def __init__(self, start: bytes, headers: list[tuple[bytes, bytes]]):
        self.start = start
        self.headers = headers

    def get(self, name: bytes) -> bytes | None:
        for k, v in self.headers:
            if k.lower() == name:
                return v
        return None

    def has_token(self, name: bytes, token: bytes) -> bool:
        value = self.get(name)
        return value is not None and token in [t.strip().lower() for t in value.split(b",")]

    def encode(
        self, drop: frozenset[bytes] = frozenset(), extra: Iterable[tuple[bytes, bytes]] = ()
    ) -> bytes:
        named = {t.strip().lower() for t in (self.get(b"connection") or b"").split(b",") if t.strip()}
        out = [self.start]
        out += [k + b": " + v for k, v in self.headers if k.lower() not in drop and k.lower() not in named]
        out += [k + b": " + v for k, v in extra]
        return b"\r\n".join(out) + b"\r\n\r\n"


def _read_head(reader: _Reader) -> _Head | None:
    """None on a clean EOF before the message started (an idle keep-alive connection closing)."""
    line = reader.readline()
    while line in (b"\r\n", b"\n"):  # tolerate stray CRLF between messages
        line = reader.readline()
    if not line:
        return None
    headers: list[tuple[bytes, bytes]] = []
    size = len(line)
    while True:
        h = reader.readline()
        if not h:
            raise _Eof("EOF in headers")
        size += len(h)
        if size > _MAX_HEAD:
            raise _BadMessage("header block too large")
        if h in (b"\r\n", b"\n"):
            return _Head(line.rstrip(b"\r\n"), headers)
        name, sep, value = h.partition(b":")
        if not sep or not name.strip():
            raise _BadMessage(f"bad header line {h[:80]!r}")
        headers.append((name.strip(), value.strip()))


@dataclass(frozen=True)
class _Request:
    head: _Head
    method: str
    path: str
    kind: str  # body framing: "length" | "chunked"
    length: int
    expect: bool  # Expect: 100-continue with a body
    close: bool  # the client asked to close after this request
    fault: str | None
    shape: float
    plan: WireFaultPlan


def _framing(head: _Head, *, no_body: bool) -> tuple[str, int]:
    """("none" | "length" | "chunked" | "eof", length) of the body that follows ``head``."""
    if no_body:
        return "none", 0
    if head.has_token(b"transfer-encoding", b"chunked"):
        return "chunked", -1
    cl = head.get(b"content-length")
    if cl is not None:
        try:
            n = int(cl)
        except ValueError as exc:
            raise _BadMessage(f"bad Content-Length {cl!r}") from exc
        if n < 0:
            raise _BadMessage(f"bad Content-Length {cl!r}")
        return "length", n
    return "eof", -1


def _copy_body(reader: _Reader, send: Callable[[bytes], None], kind: str, length: int) -> None:
    """Relay one body verbatim (chunked framing and trailers included)."""
    if kind == "length":
        while length > 0:
            data = reader.read_some(min(length, _CHUNK))
            send(data)
            length -= len(data)
    elif kind == "chunked":
        while True:
            line = reader.readline()
            if not line:
                raise _Eof("EOF in chunked body")
            send(line)
            try:
                size = int(line.split(b";")[0].strip(), 16)
            except ValueError as exc:
                raise _BadMessage(f"bad chunk size {line[:40]!r}") from exc
            if size == 0:
                break
            _copy_body(reader, send, "length", size + 2)
        while True:  # trailer section, up to its blank line
            line = reader.readline()
            if not line:
                raise _Eof("EOF in chunked trailer")
            send(line)
            if line in (b"\r\n", b"\n"):
                return
    elif kind == "eof":
        while True:
            try:
                data = reader.read_some(_CHUNK)
            except _Eof:
                return
            send(data)


class _Sink:
    """Sends to the client, stopping with ``_Cut`` once ``budget`` bytes are out (None: no limit)."""

    def __init__(self, sock: socket.socket, budget: int | None = None):
        self.sock = sock
        self.budget = budget

    def __call__(self, data: bytes) -> None:
        if self.budget is None:
            self.sock.sendall(data)
            return
        take = min(len(data), self.budget)
        if take:
            self.sock.sendall(data[:take])
        self.budget -= take
        if self.budget <= 0:
            raise _Cut()


def _error_response(
    status: int, reason: str, code: str, message: str, resource: str, *, head_only: bool, close: bool
) -> bytes:
    rid = uuid.uuid4().hex[:16].upper()
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{message}</Message><Resource>{resource}</Resource>"
        f"<RequestId>{rid}</RequestId></Error>"
    ).encode()
    lines = [
        f"HTTP/1.1 {status} {reason}",
        "Content-Type: application/xml",
        f"Content-Length: {len(body)}",
        f"x-amz-request-id: {rid}",
        f"Date: {formatdate(usegmt=True)}",
        "Server: s3kv-faultproxy",
    ]
    if close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (b"" if head_only else body)


_ERRORS = {
    "slowdown_503": (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
    "error_500": (
        500,
        "Internal Server Error",
        "InternalError",
        "We encountered an internal error. Please try again.",
    ),
    "down_503": (503, "Service Unavailable", "ServiceUnavailable", "Service is unable to handle request."),
    "bad_gateway": (502, "Bad Gateway", "BadGateway", "The proxy could not reach the upstream server."),
}


def _set_rst(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


class FaultProxy:
    """A threaded HTTP/1.1 reverse proxy on ``127.0.0.1:<free port>`` that injects wire faults.

    One thread per client connection (keep-alive is kept with the client); one fresh upstream
    connection per request (``Connection: close`` upstream, so no stale-socket retries here).
    Every socket has a timeout, and ``stop()`` shuts every socket down and joins every thread.
    """

    def __init__(
        self,
        upstream_host: str,
        upstream_port: int,
        plan: WireFaultPlan | None = None,
        *,
        seed: int = 0,
        client_timeout_s: float = 60.0,
        upstream_connect_timeout_s: float = 5.0,
        upstream_timeout_s: float = 60.0,
        max_events: int = 100_000,
    ):
        self.upstream = (upstream_host, int(upstream_port))
        self.client_timeout_s = client_timeout_s
        self.upstream_connect_timeout_s = upstream_connect_timeout_s
        self.upstream_timeout_s = upstream_timeout_s
        self._plan = plan or WireFaultPlan()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()  # state and counters; never held across I/O
        self._control = threading.Lock()  # serialises set_down / stop (listener changes)
        self._stopping = threading.Event()
        self._listener: socket.socket | None = None
        self._port: int | None = None
        self._accept_thread: threading.Thread | None = None
        self._threads: set[threading.Thread] = set()
        self._socks: set[socket.socket] = set()
        self._clients: set[socket.socket] = set()
        self._down: str | None = None
        self._plan_faults = 0
        self._seq = 0
        self._counts: dict[str, int] = {}
        self._by_method: dict[str, int] = {}
        self._events: deque[WireEvent] = deque(maxlen=max_events)

    @classmethod
    def for_url(cls, endpoint_url: str, plan: WireFaultPlan | None = None, **kwargs: object) -> FaultProxy:
        """A proxy in front of ``http://host:port`` (e.g. ``EmbeddedS3.endpoint_url``)."""
        parts = urlsplit(endpoint_url)
        if parts.scheme != "http" or not parts.hostname or not parts.port:
            raise ValueError(f"FaultProxy needs an http://host:port upstream, got {endpoint_url!r}")
        return cls(parts.hostname, parts.port, plan, **kwargs)  # type: ignore[arg-type]

    # -- life cycle --------------------------------------------------------------------
    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("FaultProxy is not started")
        return self._port

    @property
    def endpoint_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def start(self) -> FaultProxy:
        if self._accept_thread is not None:
            return self
        self._stopping.clear()
        self._listener = self._listen(0)
        self._port = self._listener.getsockname()[1]
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name="faultproxy-accept", daemon=True
        )
        self._accept_thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Close the listener and every connection, then join every thread (prompt: no waits)."""
        self._stopping.set()
        deadline = time.monotonic() + timeout_s
        with self._control:
            with self._lock:
                ls, self._listener = self._listener, None
                accept, self._accept_thread = self._accept_thread, None
            if ls is not None:
                self._close_listener(ls)
        if accept is not None:
            accept.join(timeout_s)  # after this no connection thread can appear
        with self._lock:
            socks, threads = list(self._socks), list(self._threads)
        for s in socks:  # wakes every blocked recv/send; a socket tracked later shuts itself
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in [*threads, *([accept] if accept else [])] if t.is_alive()]
        if alive:
            raise RuntimeError(f"FaultProxy.stop: threads still running after {timeout_s:g}s: {alive}")

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        where = self.endpoint_url if self._port else "not started"
        return f"FaultProxy({where} -> {self.upstream[0]}:{self.upstream[1]})"

    # -- runtime control ---------------------------------------------------------------
    @property
    def plan(self) -> WireFaultPlan:
        return self._plan

    def set_plan(self, plan: WireFaultPlan) -> None:
        """Swap the plan (the RNG sequence continues; the ``max_faults`` count restarts)."""
        with self._lock:
            self._plan = plan
            self._plan_faults = 0

    def set_down(self, down: bool = True, *, mode: Literal["refuse", "503"] = "refuse") -> None:
        """Simulate an outage. ``refuse``: the port stops listening (connection refused) and open
        connections are reset; ``503``: every request gets ``503 ServiceUnavailable``."""
        if mode not in ("refuse", "503"):
            raise ValueError(f"set_down mode must be 'refuse' or '503', got {mode!r}")
        with self._control:
            if self._accept_thread is None:
                raise RuntimeError("FaultProxy is not started")
            self._set_down(down, mode)

    def _set_down(self, down: bool, mode: str) -> None:
        with self._lock:
            self._down = mode if down else None
            if down and mode == "refuse":
                ls, self._listener = self._listener, None
                victims = list(self._clients)
            else:
                ls, victims = None, []
            reopen = not (down and mode == "refuse") and self._listener is None
        if ls is not None:
            self._close_listener(ls)
        for s in victims:
            _set_rst(s)
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        if reopen:
            new = self._listen(self.port)  # SO_REUSEADDR: the old port comes straight back
            with self._lock:
                self._listener = new

    def stats(self) -> dict[str, Any]:
        """Counters: ``requests``, ``by_method``, ``faults`` (by type, those that took effect),
        ``faults_total``, ``truncate_skipped``, ``down_503``, ``down_refused``, ``upstream_errors``,
        ``connections``. ``events()`` has the per-request decisions."""
        with self._lock:
            c = dict(self._counts)
            return {
                "requests": self._seq,
                "by_method": dict(self._by_method),
                "faults": {f: c.get(f, 0) for f in FAULTS},
                "faults_total": sum(c.get(f, 0) for f in FAULTS),
                "truncate_skipped": c.get("truncate_skipped", 0),
                "down_503": c.get("down_503", 0),
                "down_refused": c.get("down_refused", 0),
                "upstream_errors": c.get("upstream_errors", 0),
                "connections": c.get("connections", 0),
            }

    def events(self) -> list[WireEvent]:
        """Every request in arrival order with the fault it got (bounded by ``max_events``)."""
        with self._lock:
            return list(self._events)

    # -- plumbing ----------------------------------------------------------------------
    def _count(self, what: str) -> None:
        self._counts[what] = self._counts.get(what, 0) + 1

    def _listen(self, port: int) -> socket.socket:
        ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            ls.bind((LOOPBACK, port))
            ls.listen(256)
        except OSError:
            ls.close()
            raise
        ls.settimeout(0.25)  # the accept loop also polls, in case a close does not wake accept()
        return ls

    @staticmethod
    def _close_listener(ls: socket.socket) -> None:
        with contextlib.suppress(OSError):
            ls.shutdown(socket.SHUT_RDWR)  # wakes a blocked accept() on Linux
        ls.close()

    def _track(self, sock: socket.socket, client: bool = False) -> None:
        with self._lock:
            self._socks.add(sock)
            if client:
                self._clients.add(sock)
        if self._stopping.is_set():  # raced with stop(): its shutdown pass may have missed us
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _untrack_close(self, sock: socket.socket, rst: bool = False) -> None:
        with self._lock:
            self._socks.discard(sock)
            self._clients.discard(sock)
        if rst:
            _set_rst(sock)
        with contextlib.suppress(OSError):
            sock.close()

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            ls = self._listener
            if ls is None:
                self._stopping.wait(0.05)
                continue
            try:
                conn, _ = ls.accept()
            except (TimeoutError, OSError):
                continue
            with self._lock:
                refuse = self._down == "refuse" or self._stopping.is_set()
                if not refuse:
                    self._count("connections")
            if refuse:
                _set_rst(conn)
                conn.close()
                continue
            t = threading.Thread(target=self._serve, args=(conn,), name="faultproxy-conn", daemon=True)
            with self._lock:
                self._threads.add(t)
            t.start()

    def _decide(self, method: str, path: str) -> tuple[str | None, float, float, WireFaultPlan]:
        """(fault, shape draw in [0,1), latency, plan) of the next request; three draws always."""
        with self._lock:
            self._seq += 1
            self._by_method[method] = self._by_method.get(method, 0) + 1
            u, shape, jitter = self._rng.random(), self._rng.random(), self._rng.random()
            plan = self._plan
            fault: str | None = None
            if self._down is not None:
                fault = "down_refused" if self._down == "refuse" else "down_503"
                self._count(fault)
            elif (plan.ops is None or method in plan.ops) and (
                plan.max_faults is None or self._plan_faults < plan.max_faults
            ):
                acc = 0.0
                for name in FAULTS:
                    acc += getattr(plan, name)
                    if u < acc:
                        fault = name
                        self._plan_faults += 1
                        if name != "truncate":  # counted where it takes effect (needs a body)
                            self._count(name)
                        break
            self._events.append(WireEvent(self._seq, method, path, fault))
            return fault, shape, plan.latency_s + jitter * plan.latency_jitter_s, plan

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(self.client_timeout_s)
        with contextlib.suppress(OSError):
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._track(conn, client=True)
        reader = _Reader(conn)
        how = "close"  # how it ends: close | fin (half-close first) | rst | linger (drain, then close)
        try:
            while not self._stopping.is_set():
                head = _read_head(reader)
                if head is None:
                    break
                how = self._handle(conn, reader, head)
                if how != "keep":
                    break
        except _BadMessage:
            with contextlib.suppress(OSError):
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        except (_Eof, OSError):
            pass
        finally:
            if how == "linger":
                self._linger(conn)
            elif how == "fin":
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_WR)
            self._untrack_close(conn, rst=how == "rst")
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _linger(self, conn: socket.socket) -> None:
        """Half-close and drain what the client still sends (a body we did not want), so that
        closing does not turn into an RST that could destroy the answer in flight."""
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_WR)
            conn.settimeout(0.25)
            end = time.monotonic() + 2.0
            while time.monotonic() < end and conn.recv(_CHUNK):
                pass

    def _sleep(self, seconds: float) -> None:
        if seconds > 0:
            self._stopping.wait(seconds)

    def _handle(self, conn: socket.socket, reader: _Reader, head: _Head) -> str:
        """Serve one request; returns how the connection goes on: keep | close | fin | rst | linger."""
        try:
            method_b, target_b, version = head.start.split(b" ", 2)
        except ValueError as exc:
            raise _BadMessage(f"bad request line {head.start[:80]!r}") from exc
        method, path = method_b.decode("latin-1").upper(), target_b.decode("latin-1")
        kind, length = _framing(head, no_body=False)
        if kind == "eof":  # a request without Content-Length / chunked has no body
            kind, length = "length", 0
        has_body = kind == "chunked" or length > 0
        fault, shape, delay, plan = self._decide(method, path)
        req = _Request(
            head,
            method,
            path,
            kind,
            length,
            expect=has_body and head.has_token(b"expect", b"100-continue"),
            close=head.has_token(b"connection", b"close")
            or (version.strip() == b"HTTP/1.0" and not head.has_token(b"connection", b"keep-alive")),
            fault=fault,
            shape=shape,
            plan=plan,
        )
        self._sleep(delay)
        if self._stopping.is_set() or fault == "down_refused":
            return "rst"
        if fault in ("slowdown_503", "error_500", "down_503"):
            return self._answer_here(conn, reader, req, fault)
        if fault == "reset" and self._reset_phase(plan, shape)[0] == "before":
            return "rst"
        try:
            up = socket.create_connection(self.upstream, timeout=self.upstream_connect_timeout_s)
        except OSError:
            return self._bad_gateway(conn, reader, req)
        up.settimeout(self.upstream_timeout_s)
        with contextlib.suppress(OSError):
            up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._track(up)
        try:
            return self._forward(conn, reader, up, req)
        finally:
            self._untrack_close(up)

    def _answer_here(self, conn: socket.socket, reader: _Reader, req: _Request, kind: str) -> str:
        """An error answered by the proxy. With Expect the client holds its body back (or already
        sent a small one with the head): answer, then drain and close. Otherwise the body is on
        its way: read past it and keep the connection."""
        if not req.expect:
            _copy_body(reader, lambda _d: None, req.kind, req.length)
        close = req.close or req.expect
        status, reason, code, message = _ERRORS[kind]
        resource = req.path.split("?", 1)[0]
        conn.sendall(
            _error_response(
                status, reason, code, message, resource, head_only=req.method == "HEAD", close=close
            )
        )
        return "linger" if req.expect else ("close" if close else "keep")

    def _bad_gateway(self, conn: socket.socket, reader: _Reader, req: _Request) -> str:
        with self._lock:
            self._count("upstream_errors")
        return self._answer_here(conn, reader, dataclasses.replace(req, close=True), "bad_gateway")

    @staticmethod
    def _reset_phase(plan: WireFaultPlan, shape: float) -> tuple[str, float]:
        """(phase, fraction in [0,1)) of a reset, both from the one shape draw."""
        if plan.reset_when != "any":
            return plan.reset_when, shape
        scaled = shape * 3
        return ("before", "after", "mid")[min(int(scaled), 2)], scaled % 1.0

    def _forward(self, conn: socket.socket, reader: _Reader, up: socket.socket, req: _Request) -> str:
        if req.expect:
            conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")

        def up_send(data: bytes) -> None:
            try:
                up.sendall(data)
            except OSError as exc:
                raise _UpstreamGone() from exc

        body_ok = True
        try:
            up_send(req.head.encode(drop=_HOP, extra=[(b"Connection", b"close")]))
            _copy_body(reader, up_send, req.kind, req.length)
        except _UpstreamGone:
            # Upstream stopped reading (it may have answered early). The client's body is now out
            # of step with us, so whatever happens this connection closes after the answer.
            body_ok = False

        ureader = _Reader(up)
        try:
            while True:  # skip interim 1xx answers (we removed Expect; servers may send them anyway)
                rhead = _read_head(ureader)
                if rhead is None:
                    raise _Eof("upstream closed without answering")
                status = rhead.start.split(b" ", 2)
                code = int(status[1]) if len(status) > 1 and status[1].isdigit() else 0
                if not 100 <= code < 200 or code == 101:
                    break
        except (_Eof, _BadMessage, OSError):
            if not body_ok:
                return "rst"
            return self._bad_gateway(conn, reader, dataclasses.replace(req, kind="length", length=0))
        no_body = req.method == "HEAD" or code in (204, 304) or code < 200
        kind, length = _framing(rhead, no_body=no_body)
        close = req.close or not body_ok or kind == "eof"
        out_head = rhead.encode(drop=_HOP, extra=[(b"Connection", b"close")] if close else [])

        budget: int | None = None
        end = "close" if close else "keep"
        if req.fault == "reset":
            phase, frac = self._reset_phase(req.plan, req.shape)
            if phase == "after":
                return "rst"
            budget, end = self._cut(len(out_head), kind, length, frac), "rst"
        elif req.fault == "truncate":
            has_body = kind != "none" and length != 0
            with self._lock:
                self._count("truncate" if has_body else "truncate_skipped")
            if has_body:
                budget, end = self._cut(len(out_head), kind, length, req.shape), "fin"
        elif req.fault == "truncate_head":
            budget, end = 1 + int(req.shape * (len(out_head) - 2)), "fin"
        elif req.fault == "stall" and self._hold(conn, req.plan.stall_s):
            return "close"  # the client gave up while we held the answer
        send = _Sink(conn, budget)
        try:
            send(out_head)
            _copy_body(ureader, send, kind, length)
        except _Cut:
            return end
        except (_Eof, _BadMessage):
            return "close"  # upstream broke mid-body: pass the break on (the client sees a short body)
        return end

    @staticmethod
    def _cut(head_len: int, kind: str, length: int, frac: float) -> int:
        """Bytes to let through: the head and part of the body, or part of the head if there is
        no body. Chunked / EOF-delimited bodies (rare from S3) are cut within their first KiB."""
        if kind == "length" and length > 0:
            return head_len + min(int(frac * length), length - 1)
        if kind in ("chunked", "eof"):
            return head_len + int(frac * 1024)
        return 1 + int(frac * (head_len - 2))

    def _hold(self, conn: socket.socket, seconds: float) -> bool:
        """Wait up to ``seconds``; True if the client hung up (or we are stopping) meanwhile."""
        end = time.monotonic() + seconds
        while not self._stopping.is_set():
            left = end - time.monotonic()
            if left <= 0:
                return False
            conn.settimeout(min(left, 0.1))
            try:
                if not conn.recv(1, socket.MSG_PEEK):
                    return True
                return False  # the client sent more (pipelining): stop holding, answer now
            except TimeoutError:
                continue
            except OSError:
                return True
            finally:
                with contextlib.suppress(OSError):
                    conn.settimeout(self.client_timeout_s)
        return True


def main(argv: list[str] | None = None) -> int:
    """``python -m s3kv.store.faultproxy http://127.0.0.1:PORT [--seed N] [--rate NAME=P ...]``:
    run a proxy until stdin closes or SIGTERM, printing its endpoint as the first stdout line."""
    import argparse
    import json
    import signal
    import sys

    ap = argparse.ArgumentParser(prog="python -m s3kv.store.faultproxy", description=main.__doc__)
    ap.add_argument("upstream")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="a WireFaultPlan field, e.g. reset=0.05 or stall_s=2 (repeatable)",
    )
    args = ap.parse_args(argv)
    fields = {f.name: f for f in dataclasses.fields(WireFaultPlan)}
    values: dict[str, object] = {}
    for item in args.set:
        name, _, value = item.partition("=")
        if name not in fields:
            ap.error(f"unknown WireFaultPlan field {name!r}")
        if name == "ops":
            values[name] = frozenset(value.split(","))
        elif name == "reset_when":
            values[name] = value
        else:
            values[name] = int(value) if name == "max_faults" else float(value)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    plan = WireFaultPlan(**values)  # type: ignore[arg-type]
    with FaultProxy.for_url(args.upstream, plan, seed=args.seed) as proxy:
        print(json.dumps({"endpoint_url": proxy.endpoint_url}), flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while sys.stdin.read(1):
                pass
        print(json.dumps(proxy.stats()), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
