"""Settings from env vars, a config file and overrides (s3kv/config.py)."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest

from s3kv.config import (
    URL_SCHEMES,
    ConfigError,
    Settings,
    auto_blocks_per_object,
    check_url,
    explicit_settings,
    load_settings,
    redact,
    unknown_env_vars,
)

URL = "s3://bucket/prefix"


def env(**kw: str) -> dict[str, str]:
    out = {"S3KV_URL": URL}
    out.update({("S3KV_" + k.upper()): v for k, v in kw.items()})
    return out


def write_json(tmp_path, data, name="s3kv.json"):
    p = tmp_path / name
    p.write_text(json.dumps(data))
    return str(p)


# ---------------------------------------------------------------- env parsing


def test_defaults_with_only_url():
    s = load_settings({"S3KV_URL": URL})
    assert s.url == URL
    assert s == Settings(url=URL)


def test_env_parsing_types():
    s = load_settings(
        env(
            blocks_per_object="4",
            save_decode="false",
            pinned="0",
            check_access="yes",
            index_ttl_s="1.5",
            load_mode="sync",
            storage_policy="all",
            sse="AES256",
            checkpoint_tokens=" 2048 ",
        )
    )
    assert s.blocks_per_object == 4 and isinstance(s.blocks_per_object, int)
    assert s.save_decode is False
    assert s.pinned is False
    assert s.check_access is True
    assert s.index_ttl_s == 1.5 and isinstance(s.index_ttl_s, float)
    assert s.load_mode == "sync"
    assert s.storage_policy == "all"
    assert s.sse == "AES256"
    assert s.checkpoint_tokens == 2048


@pytest.mark.parametrize("raw,want", [("1", True), ("TRUE", True), ("on", True), ("No", False), ("off", False)])
def test_bool_spellings(raw, want):
    assert load_settings(env(save_decode=raw)).save_decode is want


def test_unrelated_env_vars_ignored():
    s = load_settings({"S3KV_URL": URL, "HOME": "/root", "AWS_REGION": "us-east-1"})
    assert s == Settings(url=URL)


# ---------------------------------------------------------------- precedence


def test_file_then_env_then_overrides(tmp_path):
    path = write_json(
        tmp_path,
        {"url": "s3://from-file/p", "blocks_per_object": 2, "upload_threads": 7, "load_mode": "sync"},
    )
    # File only.
    s = load_settings({"S3KV_CONFIG_FILE": path})
    assert (s.url, s.blocks_per_object, s.upload_threads, s.load_mode) == ("s3://from-file/p", 2, 7, "sync")
    # Env beats file; file still supplies what env does not set.
    s = load_settings({"S3KV_CONFIG_FILE": path, "S3KV_BLOCKS_PER_OBJECT": "9", "S3KV_URL": URL})
    assert (s.url, s.blocks_per_object, s.upload_threads, s.load_mode) == (URL, 9, 7, "sync")
    # Overrides beat both; None overrides are ignored.
    s = load_settings(
        {"S3KV_CONFIG_FILE": path, "S3KV_BLOCKS_PER_OBJECT": "9"}, blocks_per_object=3, upload_threads=None
    )
    assert (s.blocks_per_object, s.upload_threads) == (3, 7)


def test_file_nested_s3kv_table(tmp_path):
    path = write_json(tmp_path, {"s3kv": {"url": URL, "staging_mib": 64}})
    s = load_settings({"S3KV_CONFIG_FILE": path})
    assert s.staging_mib == 64 and s.staging_bytes == 64 * 1024 * 1024


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib needs Python 3.11")
def test_toml_file(tmp_path):
    p = tmp_path / "s3kv.toml"
    p.write_text(f'url = "{URL}"\nmax_attempts = 3\nsave_decode = false\n')
    s = load_settings({"S3KV_CONFIG_FILE": str(p)})
    assert (s.max_attempts, s.save_decode) == (3, False)


def test_invalid_value_in_file_names_the_file_and_its_key(tmp_path):
    """Issue 40.6: the user wrote the value in the file, so the message names the file and the key,
    not an environment variable they never set."""
    path = write_json(tmp_path, {"url": URL, "download_threads": "many"})
    with pytest.raises(ConfigError) as e:
        load_settings({"S3KV_CONFIG_FILE": path})
    assert str(e.value) == f"S3KV_CONFIG_FILE={path!r}, key 'download_threads': expected an integer, got 'many'"
    # The same value from the environment names the variable.
    with pytest.raises(ConfigError, match=r"^S3KV_DOWNLOAD_THREADS / download_threads: expected an integer"):
        load_settings({"S3KV_URL": URL, "S3KV_DOWNLOAD_THREADS": "many"})


def test_env_fixes_invalid_file_value(tmp_path):
    path = write_json(tmp_path, {"url": URL, "staging_mib": -5})
    with pytest.raises(ConfigError, match=r"^S3KV_CONFIG_FILE='.*', key 'staging_mib': must be > 0, got -5$"):
        load_settings({"S3KV_CONFIG_FILE": path})
    assert load_settings({"S3KV_CONFIG_FILE": path, "S3KV_STAGING_MIB": "8"}).staging_mib == 8


# ---------------------------------------------------------------- file errors


def test_unknown_key_in_file(tmp_path):
    path = write_json(tmp_path, {"url": URL, "blocks_per_objekt": 4})
    with pytest.raises(ConfigError) as ei:
        load_settings({"S3KV_CONFIG_FILE": path})
    assert "blocks_per_objekt" in str(ei.value)
    assert "S3KV_CONFIG_FILE" in str(ei.value)


def test_unknown_override():
    with pytest.raises(ConfigError, match="no_such_knob"):
        load_settings({"S3KV_URL": URL}, no_such_knob=1)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="S3KV_CONFIG_FILE"):
        load_settings({"S3KV_CONFIG_FILE": str(tmp_path / "nope.json")})


def test_unparsable_file(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text("{not json")
    with pytest.raises(ConfigError, match="S3KV_CONFIG_FILE"):
        load_settings({"S3KV_CONFIG_FILE": str(p)})
    p.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="S3KV_CONFIG_FILE"):
        load_settings({"S3KV_CONFIG_FILE": str(p)})


# ---------------------------------------------------------------- URL


def test_missing_url_message():
    with pytest.raises(ConfigError) as ei:
        load_settings({})
    msg = str(ei.value)
    assert "S3KV_URL" in msg and "s3://" in msg


def test_missing_url_allowed_when_not_required():
    assert load_settings({}, require_url=False).url == ""


def test_url_without_scheme():
    with pytest.raises(ConfigError, match="S3KV_URL"):
        load_settings({"S3KV_URL": "my-bucket/prefix"})


# ---------------------------------------------------------------- every invalid value names its setting

INVALID = {
    "blocks_per_object": ["-1", "x", "1.5"],
    "target_object_mib": ["0", "-32"],
    "max_blocks_per_object": ["0", "-1"],
    "load_mode": ["eager", ""],
    "save_decode": ["maybe"],
    "storage_policy": ["none"],
    "write_policy": ["always"],
    "write_min_return": ["0", "inf", "x"],
    "offer_guard": ["sometimes"],
    "checkpoint_tokens": ["0", "-4096"],
    "window_margin_blocks": ["-1"],
    "min_hit_blocks": ["0", "-2"],
    "branch_tails": ["sometimes"],
    "staging_mib": ["0", "-1", "lots"],
    "pinned": ["2"],
    "batch_copies": ["maybe"],
    "upload_threads": ["0", "-1"],
    "download_threads": ["0"],
    "max_concurrency": ["0"],
    "lookup_probe_budget": ["0"],
    "index_max_entries": ["-1"],
    "index_ttl_s": ["-0.5", "soon"],
    "negative_ttl_s": ["-1"],
    "connect_timeout_s": ["-1"],
    "read_timeout_s": ["-1"],
    "retry_deadline_s": ["-1"],
    "max_attempts": ["0"],
    "load_timeout_s": ["-1", "nan"],
    "load_stall_s": ["-1", "nan"],
    "quarantine_s": ["-1"],
    "delete_corrupt": ["perhaps"],
    "exit_drain_s": ["-2"],
    "request_state_ttl_s": ["-3"],
    "multipart_threshold_mib": ["0"],
    "multipart_part_mib": ["4", "-8"],
    "sse": ["kms", "AES-256"],  # any case is accepted: tests/test_cli_settings.py
    "breaker_failures": ["0"],
    "breaker_reset_s": ["-1"],
    "breaker_stall_s": ["-1"],
    "lookup_timeout_s": ["-2", "-0.5"],
    "lookup_stall_fraction": ["0", "-0.5", "nan"],
    "lookup_max_stall_ms": ["-1"],
    "prefill_tokens_per_s": ["-1", "fast"],
    "warm_up_s": ["-1"],
    "lookup_max_pending": ["-1"],
    "lookup_head_concurrency": ["0"],
    "lookup_head_processes": ["-2", "many"],
    "lookup_summary_s": ["-1", "often"],
    "lookup_summary_max_objects": ["0"],
    "lookup_summary_trust_s": ["-1"],
    "fleet_index_s": ["-1", "often"],
    "fleet_index_trust_s": ["-1"],
    "fleet_index_max_objects": ["0"],
    "lookup_max_added_latency_ms": ["-1", "nan"],
    "s3_client": ["curl", "boto"],
    "metrics_port": ["-1", "65536"],
    "metrics_addr": ["example.com", "300.1.1.1", ""],
    "check_access": ["sometimes"],
    "cost_put_per_1k_usd": ["-0.005", "cheap"],
    "cost_get_per_1k_usd": ["-1", "inf"],
    "cost_gb_month_usd": ["-0.023"],
    "retention_h": ["-30", "nan", "0"],
    "range_split_mib": ["0"],
    "refresh_on_hit": ["sometimes"],
    "retention_auto": ["maybe"],
    "gpu_usd_per_hour": ["0", "inf"],
    "gpu_peak_tflops": ["-1", "nan"],
    "prefill_mfu": ["0", "1.5"],
    "integrity_key": ["too-short-secret", "a-long-enough-secret-but with-a-space-0123"],
    "integrity_key_file": ["/nonexistent/s3kv-integrity-key"],
    "integrity_previous_keys": ["0123456789abcdef0123456789abcdef01234567,short"],
    "integrity_previous_keys_file": ["/nonexistent/s3kv-previous-keys"],
    "identity_cache_dir": ["relative/cache"],
    "lora_settle_s": ["-1", "soon"],
    "host_cache_gb": ["-2", "-0.5", "inf", "nan", "lots"],
    "host_cache_verify": ["sometimes"],
}
#: Never echoed in an error message (they would land in logs).
SECRETS = {"integrity_key", "integrity_previous_keys"}


@pytest.mark.parametrize(
    "name,raw", [(n, v) for n, vs in INVALID.items() for v in vs], ids=lambda x: str(x) or "empty"
)
def test_invalid_value_names_its_setting(name, raw):
    with pytest.raises(ConfigError) as ei:
        load_settings(env(**{name: raw}))
    assert f"S3KV_{name.upper()}" in str(ei.value)
    if name in SECRETS:
        assert not any(part and part in str(ei.value) for part in raw.split(","))
    else:
        assert repr(raw) in str(ei.value) or raw.strip() in str(ei.value)


def test_invalid_table_covers_every_validated_setting():
    # Every setting but the free-form strings has at least one invalid value above.
    free = {"url", "model_id", "sse_kms_key_id"}
    names = {f.name for f in dataclasses.fields(Settings)}
    assert names - free == set(INVALID)


def test_direct_construction_validates():
    with pytest.raises(ConfigError, match="S3KV_STAGING_MIB"):
        Settings(url=URL, staging_mib=-1)
    with pytest.raises(ConfigError, match="S3KV_MULTIPART_PART_MIB"):
        Settings(url=URL).replace(multipart_part_mib=1)


def test_boundary_values_accepted():
    s = load_settings(
        env(
            blocks_per_object="0",
            window_margin_blocks="0",
            index_max_entries="0",
            multipart_part_mib="5",
            metrics_port="0",
            negative_ttl_s="0",
        )
    )
    assert s.multipart_part_mib == 5 and s.blocks_per_object == 0
    assert load_settings(env(metrics_port="65535")).metrics_port == 65535


# ---------------------------------------------------------------- blocks per object


def test_auto_blocks_per_object():
    mib = 1024 * 1024
    s = Settings(url=URL, target_object_mib=32, max_blocks_per_object=64)
    assert auto_blocks_per_object(mib, s) == 32
    assert auto_blocks_per_object(64 * 1024, s) == 64  # capped
    assert auto_blocks_per_object(100 * mib, s) == 1  # at least one
    assert auto_blocks_per_object(mib, s.replace(blocks_per_object=5)) == 5  # explicit wins


# ---------------------------------------------------------------- URL allow-list, credentials (issue 17.7)


@pytest.mark.parametrize(
    "url", ["http://example.com/kv", "ftp://host/kv", "ssh://host/kv", "zip://a.zip", "reference://x", "git://r"]
)
def test_only_allowed_schemes(url):
    with pytest.raises(ConfigError) as ei:
        load_settings({"S3KV_URL": url})
    assert "is not allowed" in str(ei.value) and "S3KV_URL" in str(ei.value)


@pytest.mark.parametrize("scheme", URL_SCHEMES)
def test_allowed_schemes_pass_the_check(scheme):
    assert check_url(f"{scheme}://somewhere/kv") == f"{scheme}://somewhere/kv"


def test_credentials_in_urls_are_refused_and_never_shown():
    for url in ("s3://AKIA123:s3cr3t@bucket/kv", "gs://token@bucket/kv", "ftp://u:pw@h/kv"):
        with pytest.raises(ConfigError) as ei:
            load_settings({"S3KV_URL": url})
        msg = str(ei.value)
        assert "s3cr3t" not in msg and "AKIA123" not in msg and "token@" not in msg and "pw@" not in msg
        assert "***@" in msg


@pytest.mark.parametrize("url", ["s3://bucket/kv?versionId=1", "s3://bucket/kv#frag", "s3://bucket/team?a/kv"])
def test_question_marks_and_fragments_are_refused_in_s3_urls(url):
    with pytest.raises(ConfigError, match="'\\?' and '#' are not allowed"):
        load_settings({"S3KV_URL": url})


def test_redact():
    # s3://b/p@q may be a secret with a '/' (issue 29.2): hidden too.
    assert redact("S3KV_URL='s3://k:v@b/p' and gs://tok@x/y, and s3://b/p@q") == (
        "S3KV_URL='s3://***@b/p' and gs://***@x/y, and s3://***@q"
    )


# ---------------------------------------------------------------- unknown env vars, explicit settings (issue 13.2)


def test_unknown_env_vars_name_the_closest_setting():
    msgs = unknown_env_vars({"S3KV_URL": URL, "S3KV_STAGING_MB": "1", "S3KV_ZZZ": "1", "S3KV_LOG_LEVEL": "INFO"})
    assert msgs == [
        "S3KV_STAGING_MB is not an s3kv setting and is ignored; did you mean S3KV_STAGING_MIB?",
        "S3KV_ZZZ is not an s3kv setting and is ignored",
    ]


def test_unknown_env_vars_are_logged_once(caplog):
    with caplog.at_level("WARNING", logger="s3kv.config"):
        for _ in range(3):
            load_settings({"S3KV_URL": URL, "S3KV_UPLOAD_THREAD": "2"})
    hits = [r for r in caplog.records if "S3KV_UPLOAD_THREAD " in r.getMessage()]
    assert len(hits) == 1 and "did you mean S3KV_UPLOAD_THREADS?" in hits[0].getMessage()


def test_explicit_settings_say_where_each_came_from(tmp_path):
    path = write_json(tmp_path, {"staging_mib": 64, "url": URL})
    got = explicit_settings({"S3KV_CONFIG_FILE": path, "S3KV_LOAD_MODE": "sync", "S3KV_URL": URL})
    assert got == {"staging_mib": "S3KV_CONFIG_FILE", "url": "S3KV_URL", "load_mode": "S3KV_LOAD_MODE"}
