"""``s3kv demo`` as a newcomer runs it (issue 33.3, 33.6): from a directory that holds a folder
named ``s3kv`` (a clone's parent), through the installed console script, reading its output."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

#: Words of the code, not of the user: none may reach the demo's table unexplained.
JARGON = ("rung", "contained errors", "group0:", "group1:", "window256", "parked")


def _console_script() -> list[str]:
    """The ``s3kv`` script pip installed beside this interpreter (what a user types)."""
    script = Path(sys.executable).parent / "s3kv"
    return [str(script)] if script.exists() else [sys.executable, "-m", "s3kv.cli"]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory) -> subprocess.CompletedProcess[str]:
    cwd = tmp_path_factory.mktemp("clone-parent")
    shadow = cwd / "s3kv"
    shadow.mkdir()
    # A clone's parent holds the clone's folder; here one that fails loudly if it is ever imported.
    (shadow / "__init__.py").write_text("raise ImportError('the s3kv folder in the working directory was imported')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("S3KV_", "AWS_", "PYTHON"))}
    env["AWS_EC2_METADATA_DISABLED"] = "true"
    env["S3KV_LOAD_MODE"] = "sync"  # a setting both clusters override with a warning, said once (issue 40.5)
    return subprocess.run([*_console_script(), "demo"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def test_demo_runs_from_a_directory_holding_an_s3kv_folder(demo_run):
    assert demo_run.returncode == 0, demo_run.stderr
    assert "ImportError" not in demo_run.stderr and "imported" not in demo_run.stderr
    assert re.search(r"^warm cluster B: .* kv_mismatches: 0 ", demo_run.stdout, re.M), demo_run.stdout


def test_demo_output_explains_its_figures_in_plain_words(demo_run):
    out = demo_run.stdout
    for word in JARGON:
        assert word not in out, (word, out)
    why = re.findall(r"^  why: (.*)$", out, re.M)
    assert len(why) == 2, out
    assert why[0].startswith("cluster A's hits are its own: each conversation's next turn loads the earlier turn")
    assert "a hit ends on a 32-token block before the prompt's last token" in why[1]
    assert "new users share only the 768-token system prompt" in why[1] and "so they load 512" in why[1]
    assert re.search(r"^  served/prompt tokens per request: turn 1 .* \| turn 2 .* \| turn 3 .* \| new users ",
                     out, re.M), out
    assert "no errors inside s3kv's hooks" in out
    assert re.search(r"^stored: [\d.]+ MiB in \d+ objects for the full-attention layers, [\d.]+ MiB in \d+ objects "
                     r"for the sliding-window layers \(window 256 tokens\)$", out, re.M), out


def test_demo_does_not_point_at_a_server_that_has_stopped(demo_run):
    [store] = [ln for ln in demo_run.stdout.splitlines() if ln.startswith("store: ")]
    assert "http://" not in store, store
    assert store.endswith("S3 server, stopped now with the demo's objects; s3kv demo --keep keeps it running "
                          "to look inside with s3kv ls, stats, verify)"), store


def test_demo_warnings_name_s3kv_once_and_the_engine_it_has(demo_run):
    warnings = [ln for ln in demo_run.stderr.splitlines() if "warning" in ln]
    assert warnings, demo_run.stderr
    assert not any(ln.startswith("s3kv: warning: s3kv") for ln in warnings), warnings
    sync = [ln for ln in warnings if "S3KV_LOAD_MODE=sync" in ln]
    assert len(sync) == 1 and "no TensorRT-LLM line can" in sync[0] and "so loads are async" in sync[0], sync
    assert len(warnings) == len(set(warnings)), warnings  # each warning once per run, not once per cluster
    assert "this TensorRT-LLM" not in demo_run.stderr
    # A production engine's warnings that do not apply to the demo: its embedded store is signed
    # with a key of the run's own, and its simulated model is named.
    assert "integrity tags are off" not in demo_run.stderr and "identity is weak" not in demo_run.stderr
