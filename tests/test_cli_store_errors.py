"""Store errors read the same in every command (issue 33.1), and the access advice matches what
engines may do (33.4): each test runs the command as a user would and asserts its one line."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from click.testing import CliRunner

from s3kv.cli import main

REPO = Path(__file__).resolve().parents[1]
OPS = (["ls"], ["stats"], ["verify"], ["gc", "--older-than", "0", "--yes"])
#: What a client's own dump looks like; none of it may reach the user's line.
RAW = ("Debug source", "Generic {", "<?xml", "Unauthenticated {", "RetryError", "GenericError", "<Code>")


def _env(server_env: dict[str, str], **changes: str | None) -> dict[str, str | None]:
    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith(("S3KV_", "AWS_"))}
    env.update(server_env)
    env.update(AWS_EC2_METADATA_DISABLED="true", S3KV_MAX_ATTEMPTS="1")
    env.update(changes)
    return env


def _line(env: dict[str, str | None], *args: str) -> str:
    r = CliRunner().invoke(main, list(args), env=env)
    assert r.exit_code == 1, r.output
    lines = [ln for ln in r.output.splitlines() if ln.startswith("Error:")]
    assert len(lines) == 1 and "Traceback" not in r.output, r.output
    for raw in RAW:
        assert raw not in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def weed(seaweed_s3):
    return {k: v for k, v in seaweed_s3.env().items()}


@pytest.mark.parametrize(
    "fault, expect",
    [
        ({"AWS_ENDPOINT_URL_S3": "http://127.0.0.1:9"},
         "cannot reach the S3 endpoint http://127.0.0.1:9 (endpoint from $AWS_ENDPOINT_URL_S3); is it running"),
        ({"AWS_SECRET_ACCESS_KEY": "not-the-secret"},
         "rejected the secret key (SignatureDoesNotMatch); check AWS_SECRET_ACCESS_KEY"),
        ({"AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None, "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
          "AWS_CONFIG_FILE": "/nonexistent"},
         "no AWS credentials found; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE"),
    ],
    ids=["endpoint-down", "wrong-secret", "no-credentials"],
)
@pytest.mark.parametrize("client", ["obstore", "boto3"])
def test_every_command_words_a_store_fault_alike(weed, fault, expect, client):
    env = _env(weed, **fault, S3KV_S3_CLIENT=client)
    url = weed["S3KV_URL"]
    lines = {" ".join(cmd): _line(env, *cmd) for cmd in OPS}
    for cmd, line in lines.items():
        assert line.startswith(f"Error: {url}: ") and expect in line, (cmd, line)
    assert len(set(lines.values())) == 1, lines  # one wording, whichever command
    demo = _line(env, "demo", "--url", url)
    assert demo.startswith(f"Error: {url}/demo-") and expect in demo, demo


def test_missing_bucket_reads_alike_in_ops_and_demo(weed):
    env = _env(weed)
    for cmd in (*OPS, ["demo"]):
        line = _line(env, *cmd, "--url", "s3://no-such-bucket-here/kv")
        assert "bucket 'no-such-bucket-here' does not exist at http://127.0.0.1:" in line, line
        assert "create it, or fix the bucket name in the URL" in line


class _Denied(BaseHTTPRequestHandler):
    """An S3 endpoint that answers every request 403 AccessDenied (a policy without the grants)."""

    def _deny(self) -> None:
        body = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>AccessDenied</Code>'
                b"<Message>Access Denied</Message></Error>")
        self.send_response(403)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(0 if self.command == "HEAD" else len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _deny

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def denying_endpoint():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Denied)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_access_denied_advice_never_asks_engines_to_delete(denying_endpoint):
    env = _env({"AWS_ENDPOINT_URL_S3": denying_endpoint, "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s",
                "AWS_REGION": "us-east-1"})
    demo = _line(env, "demo", "--url", "s3://some-bucket/kv")
    assert "denied access (AccessDenied); engines need s3:GetObject, s3:PutObject" in demo, demo
    assert "DeleteObject" not in demo and "(no delete)" in demo
    ls = _line(env, "ls", "--url", "s3://some-bucket/kv")
    assert "denied access (AccessDenied); s3kv ls/stats/verify need s3:ListBucket and s3:GetObject" in ls, ls
    assert "gc also s3:DeleteObject" in ls

    # What an engine itself reads at start-up (its connector's access check), in a fresh process.
    code = ("from s3kv.config import load_settings; from s3kv.engine.runtime import open_runtime_store\n"
            "store, _ = open_runtime_store(load_settings())\n"
            "try:\n    store.check_access()\nexcept Exception as e:\n    print(e)\n")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("S3KV_", "AWS_"))}
    clean.update({k: v for k, v in env.items() if v is not None}, S3KV_URL="s3://some-bucket/kv")
    out = subprocess.run([sys.executable, "-c", code], env=clean,
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert "access denied" in out.stdout, out.stdout + out.stderr
    assert "s3:GetObject, s3:PutObject, s3:AbortMultipartUpload and s3:ListBucket" in out.stdout
    assert "s3:DeleteObject" not in out.stdout and "engines need no delete" in out.stdout
