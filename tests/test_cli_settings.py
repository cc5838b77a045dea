"""Settings as a user gets them wrong (issue 33.2, 33.5): the settings file, ``--url``, the URL's
scheme, enum case, and a file:// cache that does not exist. Each test runs the command and
asserts its one line."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from s3kv.cli import main

REPO = Path(__file__).resolve().parents[1]
ACCEPTED = ("expected JSON (any name), TOML (a name ending in .toml, Python >= 3.11) or YAML (a name ending in "
            ".yaml or .yml, read with PyYAML)")


def invoke(*args: str, **env: str):
    base: dict[str, str | None] = {k: None for k in os.environ if k.startswith("S3KV_")}
    base.update(env)
    return CliRunner().invoke(main, list(args), env=base)


def error_line(result) -> str:
    assert result.exit_code != 0, result.output
    errs = [ln for ln in result.output.splitlines() if ln.startswith("Error:")]
    assert len(errs) == 1 and "Traceback" not in result.output, result.output
    return errs[0]


# --------------------------------------------------------------------------- 33.2: the settings file


def test_config_file_errors_name_the_variable_and_the_file(tmp_path):
    binary = tmp_path / "s3kv.json"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00")
    yaml_file = tmp_path / "s3kv.yaml"
    yaml_file.write_text("url: s3://bucket/kv\nstaging_mib: [64\n")
    fifo = tmp_path / "s3kv.fifo"
    os.mkfifo(fifo)
    cases = {
        tmp_path / "missing.json": "no such file",
        binary: f"not a text file (not UTF-8); {ACCEPTED}",
        tmp_path: "is a directory; name the settings file itself (JSON (any name), TOML",
        fifo: "is not a regular file; name a settings file (JSON (any name), TOML",
        yaml_file: "cannot parse it as YAML: expected ',' or ']', but got '<stream end>' (line 3, column 1); "
        f"{ACCEPTED}",
    }
    for path, what in cases.items():
        for cmd in (["ls"], ["demo"]):
            line = error_line(invoke(*cmd, S3KV_CONFIG_FILE=str(path)))
            assert line == f"Error: S3KV_CONFIG_FILE='{path}': {what}" or (
                line.startswith(f"Error: S3KV_CONFIG_FILE='{path}': ") and what in line
            ), (cmd, line)


def test_a_yaml_settings_file_works_and_a_bad_value_names_the_file_and_key(tmp_path):
    """Issue 40: YAML as LMCache users write it; a bad value is reported by file and key, not by
    an environment variable the user never set."""
    (tmp_path / "c").mkdir()
    path = tmp_path / "s3kv.yaml"
    path.write_text(f"s3kv:\n  url: file://{tmp_path}/c\n  staging_mib: 64\n  offer_guard: off\n")
    r = invoke("ls", S3KV_CONFIG_FILE=str(path))
    assert r.exit_code == 0 and r.output.strip() == f"no s3kv objects under file://{tmp_path}/c", r.output
    path.write_text(f"url: file://{tmp_path}/c\nstaging_mib: lots\n")
    for cmd in (["ls"], ["demo"], ["config"]):
        line = error_line(invoke(*cmd, S3KV_CONFIG_FILE=str(path)))
        assert line == f"Error: S3KV_CONFIG_FILE='{path}', key 'staging_mib': expected an integer, got 'lots'", (
            cmd, line)
        assert "S3KV_STAGING_MIB" not in line


def test_unreadable_config_file_is_one_line(tmp_path, monkeypatch):
    # chmod 000 does not stop root (these tests run as root in CI), so the read itself fails here.
    path = tmp_path / "s3kv.json"
    path.write_text("{}")
    real = pathlib.Path.read_bytes

    def denied(self: pathlib.Path) -> bytes:
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(pathlib.Path, "read_bytes", denied)
    line = error_line(invoke("ls", S3KV_CONFIG_FILE=str(path)))
    assert line == f"Error: S3KV_CONFIG_FILE='{path}': cannot read it: Permission denied"


# --------------------------------------------------------------------------- 33.5: URLs and enums


def test_ls_of_a_missing_directory_is_an_error_not_an_empty_cache(tmp_path):
    missing = tmp_path / "nonexistent" / "dir"
    for cmd in (["ls"], ["stats"], ["verify"], ["gc", "--older-than", "0"]):
        line = error_line(invoke(*cmd, "--url", f"file://{missing}"))
        assert line == f"Error: --url file://{missing}: no such directory {missing}; check the path " \
            "(engines create it when they first save)", line
    line = error_line(invoke("ls", S3KV_URL=f"file://{missing}"))
    assert line.startswith(f"Error: S3KV_URL file://{missing}: no such directory")
    missing.mkdir(parents=True)
    r = invoke("ls", "--url", f"file://{missing}")
    assert r.exit_code == 0 and r.output.strip() == f"no s3kv objects under file://{missing}", r.output


def test_a_bad_url_option_names_the_option_not_the_setting():
    for cmd in (["ls"], ["stats"], ["demo"], ["gc", "--older-than", "0"]):
        r = invoke(*cmd, "--url", "s3//x")
        assert r.exit_code == 2, r.output
        line = error_line(r)
        assert line == "Error: Invalid value for --url: expected a URL such as s3://bucket/prefix or " \
            "file:///path, got 's3//x'", line
        assert "S3KV_URL" not in r.output


def test_an_http_url_points_at_aws_endpoint_url_s3():
    r = invoke("ls", S3KV_URL="http://minio.local:9000/kv-bucket/team-a")
    line = error_line(r)
    assert "scheme 'http://' is not allowed" in line
    assert line.endswith("An S3-compatible server (MinIO, SeaweedFS ...) is named by AWS_ENDPOINT_URL_S3: "
                         "AWS_ENDPOINT_URL_S3=http://minio.local:9000 with the URL s3://kv-bucket/team-a")
    line = error_line(invoke("ls", "--url", "https://alice:hunter2@minio.local/b"))
    assert "AWS_ENDPOINT_URL_S3=https://minio.local with the URL s3://b" in line and "hunter2" not in line
    line = error_line(invoke("ls", "--url", "http://[::1]:9000/b/p"))  # IPv6 keeps its brackets
    assert line.endswith("AWS_ENDPOINT_URL_S3=http://[::1]:9000 with the URL s3://b/p"), line


@pytest.mark.parametrize("name, value, stored", [
    ("S3KV_LOAD_MODE", "Sync", "sync"),
    ("S3KV_STORAGE_POLICY", " ALL ", "all"),
    ("S3KV_S3_CLIENT", "Boto3", "boto3"),
    ("S3KV_SSE", "aes256", "AES256"),
    ("S3KV_SSE", "AWS:KMS", "aws:kms"),
])
def test_enum_settings_accept_any_case(tmp_path, name, value, stored):
    code = f"from s3kv.config import load_settings; print(load_settings(require_url=False).{name[5:].lower()})"
    env = {k: v for k, v in os.environ.items() if not k.startswith("S3KV_")}
    out = subprocess.run([sys.executable, "-c", code], env={**env, name: value}, capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert out.stdout.strip() == stored, out.stderr
    (tmp_path / "c").mkdir()
    r = invoke("ls", "--url", f"file://{tmp_path}/c", **{name: value})
    assert r.exit_code == 0, r.output


def test_a_wrong_enum_value_lists_the_accepted_ones():
    line = error_line(invoke("ls", "--url", "file:///tmp", S3KV_LOAD_MODE="Syn"))
    assert line == "Error: S3KV_LOAD_MODE / load_mode: accepted values: async, sync (any case), got 'Syn'"


# --------------------------------------------------------------------------- 40: s3kv config


def test_config_says_where_every_value_came_from_flag_over_env_over_file_over_default(tmp_path):
    import json

    path = tmp_path / "s3kv.yaml"
    path.write_text("url: s3://from-file/kv\nstaging_mib: 2048\ncheckpoint_tokens: 8192\n"
                    "integrity_key: " + "k" * 40 + "\n")
    env = {"S3KV_CONFIG_FILE": str(path), "S3KV_STAGING_MIB": "4096", "S3KV_UPLOAD_THREADS": "3"}
    r = invoke("config", "--url", "file:///tmp/flag", "--json", **env)
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    got = {k: (v["value"], v["from"]) for k, v in doc["settings"].items() if v["from"] != "default"}
    assert got == {
        "url": ("file:///tmp/flag", "flag"),  # flag over the file's
        "staging_mib": (4096, "env"),  # environment over the file's 2048
        "checkpoint_tokens": (8192, "file"),
        "upload_threads": (3, "env"),
        "integrity_key": ("***", "file"),  # a secret is never printed
    }
    assert doc["settings"]["load_mode"] == {"value": "async", "from": "default"} and doc["file"] == str(path)
    table = invoke("config", **env)
    assert table.exit_code == 0 and "k" * 40 not in table.output
    lines = table.output.splitlines()
    assert lines[0] == f"settings file: {path} (S3KV_CONFIG_FILE)"
    assert lines[1] == ("precedence: command-line flag (--url) > environment (S3KV_<NAME>) > settings file "
                        "(S3KV_CONFIG_FILE) > default")
    rows = {ln.split()[0]: ln.split(None, 2)[2] for ln in lines[4:-1]}
    assert rows == {"url": "file", "checkpoint_tokens": "file", "staging_mib":
                    "env S3KV_STAGING_MIB (over the file's 2048)", "upload_threads": "env S3KV_UPLOAD_THREADS",
                    "integrity_key": "file"}, lines
    assert lines[-1].endswith("other settings at their defaults (s3kv config --all lists them)")
    # The engine, the demo and the operator commands load the same values (same precedence).
    from s3kv.config import load_settings

    s = load_settings({**env, "S3KV_URL": "s3://from-env/kv"}, url="file:///tmp/flag")
    assert (s.url, s.staging_mib, s.checkpoint_tokens) == ("file:///tmp/flag", 4096, 8192)
    assert load_settings({**env, "S3KV_URL": "s3://from-env/kv"}).url == "s3://from-env/kv"
