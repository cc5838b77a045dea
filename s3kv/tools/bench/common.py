"""Plumbing shared by the benchmarks: the store under test, injected latency, machine facts, output.

The store a benchmark runs s3kv on is ``InstrumentedStore(RegionLatency(raw))``: requests are
counted, and each request pays ``latency_ms`` the way a store in another region would. Set-up
(pre-populating objects) and clean-up go to ``raw`` directly, uncounted and without latency.

Latency model (:class:`RegionLatency`): every PUT / GET / LIST / DELETE call is one round trip
(as in :class:`~s3kv.store.throttle.ThrottledStore`), and a batched HEAD of ``n`` keys costs
``ceil(n / concurrency)`` round trips -- a real client fans the batch out over ``concurrency``
connections, so a batch wider than that cannot finish in one. (``ThrottledStore`` charges a
batch one round trip whatever its width, which flatters wide waves.) The sleep is added to the
local server's own service time, never overlapped with it, so injected numbers are conservative
for the batched path and for the baselines alike.

Why this is one module: the plumbing every benchmark imports (store under test, latency model,
machine facts, output); one place keeps their numbers comparable.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import click

from ...core import cost as _cost
from ...store.base import HeadBatch, ObjectStore, SpanExpect, StoreWrapper
from ...store.throttle import ThrottledStore
from ..models import GEMMA3_27B, ModelSpec  # noqa: F401 - the benchmarks' model

MiB = 1 << 20
#: Bucket the embedded server is started with.
BENCH_BUCKET = "s3kv-bench"
#: Connections a client fans a batch out over (S3Options.max_concurrency's default).
DEFAULT_CONCURRENCY = 32


# --------------------------------------------------------------------------- the model we quote



#: GPU we convert FLOPs into seconds with: H100/H200 SXM dense BF16 peak (no sparsity).
GPU_NAME = "NVIDIA H100/H200 SXM (BF16 dense)"
#: Its peak, and the prefill MFU measured on an H200 (s3kv/core/cost.py says how).
GPU_PEAK_TFLOPS = _cost.GPU_PEAK_TFLOPS
PREFILL_MFU = _cost.PREFILL_MFU


# --------------------------------------------------------------------------- machine


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/meminfo") as f:
            first = f.readline().split()
            info["memory_gib"] = round(int(first[1]) / 2**20, 1)
    with contextlib.suppress(OSError, AttributeError):
        # Other work on the machine skews every number; record how busy it was.
        info["loadavg_1m"] = round(os.getloadavg()[0], 2)
    torch = sys.modules.get("torch")
    if torch is not None:
        info["torch"] = torch.__version__
        with contextlib.suppress(Exception):
            if torch.cuda.is_available():
                info["cuda_device"] = torch.cuda.get_device_name(0)
    return info


def rss_bytes() -> int:
    """Resident set size of this process now (psutil when installed, else /proc/self/statm)."""
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:
        pass
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):  # pragma: no cover - non-Linux without psutil
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


# --------------------------------------------------------------------------- latency


class RegionLatency(ThrottledStore):
    """ThrottledStore whose batched HEAD costs one round trip per ``concurrency`` keys (module doc)."""

    def __init__(self, inner: ObjectStore, latency_s: float, concurrency: int = DEFAULT_CONCURRENCY):
        super().__init__(inner, latency_s)
        self.concurrency = max(1, int(concurrency))
        #: Round trips charged so far (a benchmark reads differences).
        self.round_trips = 0

    def _rtt(self) -> None:
        self.round_trips += 1
        super()._rtt()

    def head_many(self, keys: Sequence[str]) -> HeadBatch:
        self._charge(keys)
        return self.inner.head_many(keys)

    def head_many_checked(self, keys: Sequence[str], expect: Mapping[str, SpanExpect]) -> HeadBatch:
        self._charge(keys)
        return self.inner.head_many_checked(keys, expect)

    def _charge(self, keys: Sequence[str]) -> None:
        if self.latency_s and keys:
            n = math.ceil(len(keys) / self.concurrency)
            self.round_trips += n
            time.sleep(self.latency_s * n)


class RawClient:
    """Plain single requests for the baselines: boto3 ``put_object`` / ``get_object`` on the same
    server (or the store's own put/get where there is no boto3 endpoint), each paying the same
    injected latency as s3kv's requests."""

    def __init__(
        self,
        put: Callable[[str, bytes], object],
        get: Callable[[str], bytes],
        latency_s: float,
        kind: str,
    ):
        self._put = put
        self._get = get
        self.latency_s = latency_s
        self.kind = kind

    def put(self, key: str, body: bytes) -> None:
        if self.latency_s:
            time.sleep(self.latency_s)
        self._put(key, body)

    def get(self, key: str) -> bytes:
        if self.latency_s:
            time.sleep(self.latency_s)
        return self._get(key)


def _boto3_raw(
    bucket: str, endpoint_url: str | None, latency_s: float, creds: Mapping[str, str]
) -> RawClient:
    from urllib.parse import urlsplit

    import boto3
    from botocore.config import Config

    host = urlsplit(endpoint_url or "").hostname or ""
    on_aws = host.endswith((".amazonaws.com", ".amazonaws.com.cn"))
    # Same addressing rule as S3Store: path-style for any non-AWS endpoint.
    style = "path" if endpoint_url and not on_aws else "auto"
    client = boto3.session.Session(**dict(creds)).client(  # type: ignore[arg-type]  # keyword credentials
        "s3",
        endpoint_url=endpoint_url,
        config=Config(
            retries={"max_attempts": 3, "mode": "standard"},
            max_pool_connections=64,
            # Same as S3Store: no flexible-checksum trailers, so both sides hash the same bytes (none).
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            s3={"addressing_style": style},  # type: ignore[typeddict-item,arg-type]  # a Literal in the stubs
            tcp_keepalive=True,
        ),
    )

    def put(key: str, body: bytes) -> None:
        client.put_object(Bucket=bucket, Key=key, Body=body)

    def get(key: str) -> bytes:
        return client.get_object(Bucket=bucket, Key=key)["Body"].read()

    return RawClient(put, get, latency_s, "boto3 put_object/get_object")


# --------------------------------------------------------------------------- the store under test


@dataclass
class BenchStore:
    raw: ObjectStore
    store: Any  # InstrumentedStore over RegionLatency (when latency > 0) over raw
    prefix: str
    kind: str
    where: str
    latency_ms: float
    concurrency: int
    raw_client: RawClient
    latency: RegionLatency | None = None
    #: Delay the fault proxy adds to every request on the wire (``--s3-latency-ms``).
    s3_latency_ms: float = 0.0

    def injected_round_trips(self) -> int:
        """Round trips charged injected latency so far (0 without latency)."""
        return self.latency.round_trips if self.latency is not None else 0

    def key(self, *parts: str) -> str:
        return "/".join(p.strip("/") for p in (self.prefix, *parts) if p)

    def info(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "where": self.where,
            "latency_ms_injected": self.latency_ms,
            "latency_model": (
                f"{self.latency_ms:g} ms per request; a HEAD batch of n keys costs ceil(n/{self.concurrency}) "
                "round trips; added to the server's own service time"
                if self.latency_ms
                else "none (loopback)"
            ),
            "raw_baseline_client": self.raw_client.kind,
            "s3_latency_ms": self.s3_latency_ms,
        }

    def delete_prefix(self, prefix: str) -> int:
        keys = [i.key for i in self.raw.list(prefix)]
        if keys:
            self.raw.delete_many(keys)
        return len(keys)



class SharedStore(StoreWrapper):
    """The bench owns the store; an engine's or cluster's shutdown must not close it under the next one."""

    def close(self) -> None:
        pass

@contextlib.contextmanager
def bench_store(
    url: str | None,
    *,
    server: str = "auto",
    latency_ms: float = 0.0,
    name: str = "bench",
    concurrency: int = DEFAULT_CONCURRENCY,
    keep: bool = False,
    s3_latency_ms: float | None = None,
) -> Iterator[BenchStore]:
    """The store a benchmark runs on, with a run-unique key prefix; cleaned up on exit.

    ``s3_latency_ms`` (not None): every request, set-up included, goes through s3kv's fault
    proxy, which holds it that long on the wire (``--s3-latency-ms``): an S3 store on an
    ``http://`` endpoint only (the embedded server, or ``AWS_ENDPOINT_URL_S3``)."""
    from ...store.instrument import InstrumentedStore

    if latency_ms < 0:
        raise click.BadParameter("must be >= 0", param_hint="--latency-ms")
    if s3_latency_ms is not None and s3_latency_ms < 0:
        raise click.BadParameter("must be >= 0", param_hint="--s3-latency-ms")
    latency_s = latency_ms / 1000.0
    run = f"bench/{name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    emb = proxy = None
    raw: ObjectStore
    url_prefix = ""
    cleanup = False
    try:
        if not url:
            from ...store.embedded import EmbeddedS3
            from ...store.s3 import S3Options, S3Store

            emb = EmbeddedS3(kind=server, bucket=BENCH_BUCKET).start()  # type: ignore[arg-type]
            endpoint = emb.endpoint_url
            if s3_latency_ms is not None:
                proxy = _wire_latency(endpoint, s3_latency_ms)
                endpoint = proxy.endpoint_url
            raw = S3Store(emb.bucket, endpoint_url=endpoint, options=S3Options(max_concurrency=concurrency),
                          aws_access_key_id=emb.access_key, aws_secret_access_key=emb.secret_key, url=emb.url)
            raw_client = _boto3_raw(
                emb.bucket,
                endpoint,
                latency_s,
                {
                    "aws_access_key_id": emb.access_key,
                    "aws_secret_access_key": emb.secret_key,
                    "region_name": emb.region,
                },
            )
            kind: str = emb.kind
            where = f"embedded {emb.kind} at {emb.endpoint_url}"
        else:
            from ...config import redact_url
            from ...store.factory import open_store, parse_store_url

            scheme, bucket, url_prefix = parse_store_url(url)
            if scheme == "s3":
                from ...store.s3 import S3Options

                raw = open_store(url, options=S3Options(max_concurrency=concurrency))
                # Whichever client the factory picked (boto3's S3Store, obstore's): its endpoint.
                endpoint = str(getattr(raw, "endpoint_url", "") or "")
                if s3_latency_ms is not None:
                    raw.close()
                    proxy = _wire_latency(endpoint, s3_latency_ms)
                    endpoint = proxy.endpoint_url
                    from ...store.factory import make_s3_store

                    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
                    raw = make_s3_store(bucket, options=S3Options(max_concurrency=concurrency, region=region),
                                        endpoint_url=endpoint, url=url)
                raw_client = _boto3_raw(bucket, endpoint or None, latency_s, {})
                kind, where, cleanup = "s3", redact_url(url), True  # shown: no secret of the URL's
            else:
                if s3_latency_ms is not None:
                    raise click.ClickException(
                        f"--s3-latency-ms needs an s3:// store (or no --url: the embedded server), got {url}"
                    )
                raw = open_store(url)
                raw_client = RawClient(raw.put, raw.get, latency_s, f"{type(raw).__name__}.put/get")
                kind, where = scheme, redact_url(url)
                cleanup = scheme != "memory"
        shaped = RegionLatency(raw, latency_s, concurrency) if latency_s else None
        store = InstrumentedStore(shaped if shaped is not None else raw)
        prefix = "/".join(p for p in (url_prefix, run) if p)
        if proxy is not None:
            where += f", {s3_latency_ms:g} ms added on the wire (fault proxy at {proxy.endpoint_url})"
        bs = BenchStore(raw, store, prefix, kind, where, latency_ms, concurrency, raw_client, shaped,
                        s3_latency_ms=s3_latency_ms or 0.0)
        try:
            yield bs
        finally:
            if kind == "memory" or (cleanup and not keep):
                with contextlib.suppress(Exception):
                    bs.delete_prefix(prefix + "/")
            with contextlib.suppress(Exception):
                raw.close()
    finally:
        if proxy is not None:
            proxy.stop()
        if emb is not None:
            emb.stop()


class _ProxyProcess:
    """``python -m s3kv.store.faultproxy`` in a process of its own, adding ``latency_ms`` to every
    request. Why not a thread here: the proxy runs a thread per connection, and a lookup's wave is
    hundreds of HEADs at once -- in the benchmark's process their Python would hold the GIL the
    measured engine's scheduler thread needs, and charge the proxy's work to the lookups' stall."""

    def __init__(self, endpoint_url: str, latency_ms: float):
        import subprocess

        self._proc = subprocess.Popen(
            [sys.executable, "-m", "s3kv.store.faultproxy", endpoint_url, "--set", f"latency_s={latency_ms / 1000.0}"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        try:
            self.endpoint_url = str(json.loads(line)["endpoint_url"])
        except (ValueError, KeyError, TypeError):
            self.stop()
            raise click.ClickException(f"the latency proxy in front of {endpoint_url} did not start") from None

    def stop(self) -> None:
        import subprocess

        with contextlib.suppress(OSError, ValueError):
            if self._proc.stdin is not None:
                self._proc.stdin.close()  # the proxy runs until its stdin closes
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def _wire_latency(endpoint_url: str, latency_ms: float) -> _ProxyProcess:
    """s3kv's fault proxy in front of ``endpoint_url``, holding every request ``latency_ms``."""
    from urllib.parse import urlsplit

    parts = urlsplit(endpoint_url)
    if parts.scheme != "http" or not parts.hostname or not parts.port:
        raise click.ClickException(
            f"--s3-latency-ms puts a proxy in front of an http://host:port S3 endpoint; this store's is "
            f"{endpoint_url or 'unknown'!r} (leave out --url to use the embedded server)"
        )
    return _ProxyProcess(endpoint_url, latency_ms)


# --------------------------------------------------------------------------- output


def progress(msg: str) -> None:
    """Progress goes to stderr, so ``--json`` leaves stdout holding one JSON object."""
    click.echo(msg, err=True)


def header(result: Mapping[str, Any]) -> str:
    s = result.get("store", {})
    m = result.get("machine", {})
    return (
        f"store: {s.get('where', '?')} | injected latency: {s.get('latency_ms_injected', 0):g} ms | "
        f"machine: {m.get('cores')} cores, {m.get('cpu', '?')}"
    )


def targets_line(result: Mapping[str, Any]) -> str:
    met = result.get("targets_met", {})
    want = result.get("targets", {})
    parts = [f"{k} ({want.get(k, '')}): {'MET' if v else 'NOT MET'}" for k, v in met.items()]
    return "targets: " + ("; ".join(parts) if parts else "none")


def finish(
    result: dict[str, Any],
    *,
    as_json: bool,
    table: Callable[[dict[str, Any]], str],
    plot_path: str | None = None,
    plot: Callable[[dict[str, Any], str], None] | None = None,
) -> None:
    failed = ""
    if plot_path and plot:
        try:
            plot(result, plot_path)
            result["plot"] = plot_path
        except Exception as exc:  # noqa: BLE001 - the results are printed whatever the chart does
            failed = f"--plot {plot_path}: no chart written ({getattr(exc, 'strerror', None) or exc}); the results are above"
    if as_json:
        click.echo(json.dumps(result, indent=2, default=_json_default))
    else:
        click.echo(table(result))
        if plot_path and not failed:
            click.echo(f"plot: {plot_path}")
    if failed:
        raise click.ClickException(failed)


def _json_default(o: Any) -> Any:
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if hasattr(o, "__dict__"):
        return vars(o)
    return str(o)


def rnd(x: float, nd: int = 3) -> float:
    return round(float(x), nd)


def pct(xs: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0..1) of ``xs``; 0.0 for none."""
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else 0.0


# --------------------------------------------------------------------------- click options


#: ``--json`` and ``--quick``, as every benchmark takes them.
json_option = click.option("--json", "as_json", is_flag=True, help="Print ONE JSON object on stdout (progress on stderr).")
quick_option = click.option("--quick", is_flag=True, help="Tiny sizes (tests, smoke runs).")


def plot_option(help: str = "Write a PNG chart here (checked before the benchmark starts).") -> Callable[..., Any]:
    from ..options import writable_file

    return click.option(
        "--plot", "plot_path", type=click.Path(dir_okay=False), callback=writable_file, default=None, help=help
    )


def common_options(default_latency_ms: float, plot: bool = True) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The options every store benchmark takes; ``plot=False`` for one that draws no chart (it is
    then not offered)."""

    def deco(f: Callable[..., Any]) -> Callable[..., Any]:
        opts = [
            json_option,
            *([plot_option()] if plot else []),
            click.option(
                "--url",
                default=None,
                help="Run on this store (s3://bucket/prefix, memory://name, file:///dir) instead of an "
                "embedded loopback S3 server. A run-unique prefix is used and deleted afterwards.",
            ),
            click.option(
                "--server",
                type=click.Choice(["auto", "seaweedfs", "moto"]),
                default="auto",
                show_default=True,
                help="Embedded server when no --url is given (auto: SeaweedFS if "
                "`weed` is installed, else moto).",
            ),
            click.option(
                "--latency-ms",
                type=float,
                default=default_latency_ms,
                show_default=True,
                help="Inject this much latency per request (imitates a store in another region).",
            ),
            quick_option,
            click.option("--keep", is_flag=True, help="Keep the objects written to a real bucket."),
        ]
        for o in reversed(opts):
            f = o(f)
        return f

    return deco
