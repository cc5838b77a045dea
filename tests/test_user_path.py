"""The user's path, round 3 (issue 40, points 2-6 and 8), each point run the way a user runs it:
the ``s3kv`` command in a fresh process (with this tree on PYTHONPATH), reading what it prints."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from s3kv.cli import main

REPO = Path(__file__).resolve().parents[1]
SLICE = REPO / "tests" / "fixtures" / "mooncake_slice.jsonl"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("S3KV_", "AWS_"))}
    env.update(PYTHONPATH=str(REPO), AWS_EC2_METADATA_DISABLED="true")
    env.update(extra)
    return env


def s3kv(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "s3kv.cli", *args], env=env or _env(), capture_output=True,
                          text=True, timeout=timeout, cwd=REPO.parent)


def _error(r: subprocess.CompletedProcess[str]) -> str:
    [line] = [ln for ln in r.stderr.splitlines() if ln.startswith("Error:")]
    assert "Traceback" not in r.stderr, r.stderr
    return line


# --------------------------------------------------------------------------- 2: --plot checked first


def _unwritable(tmp_path: Path) -> list[str]:
    """Paths nobody can write: under a regular file, always; a read-only directory where the tests
    do not run as root (root writes anyway); /sys, which refuses even root."""
    (tmp_path / "a-file").write_text("")
    out = [str(tmp_path / "a-file" / "p.png")]
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
        out.append(str(ro / "p.png"))
    elif os.path.isdir("/sys"):
        out.append("/sys/p.png")
    return out


@pytest.mark.parametrize("cmd", [["bench", "lookup", "--quick"], ["bench", "transfer", "--quick"],
                                 ["bench", "e2e", "--quick"], ["bench", "trace", str(SLICE)]])
def test_an_unwritable_plot_path_stops_the_bench_before_it_starts(cmd, tmp_path):
    for path in _unwritable(tmp_path):
        t0 = time.monotonic()
        r = s3kv(*cmd, "--plot", path)
        assert r.returncode == 2, r.stderr
        line = _error(r)
        assert line.startswith(f"Error: Invalid value for '--plot': cannot write {path}: "), line
        assert "OSError" not in r.stderr and "Errno" not in line
        # Nothing ran: no store, no progress line, and it took no benchmark's time.
        assert not [ln for ln in r.stderr.splitlines() if ln.startswith(("lookup:", "transfer:", "e2e:", "trace:"))]
        assert time.monotonic() - t0 < 60
        assert not Path(path).exists()


def test_a_chart_that_fails_at_the_end_still_prints_the_results(tmp_path, monkeypatch):
    from s3kv.tools.bench import plot

    def disk_full(res, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(plot, "plot_lookup", disk_full)
    out = tmp_path / "p.png"
    r = CliRunner().invoke(main, ["bench", "lookup", "--quick", "--url", "memory://plot-fails", "--prompts", "1k",
                                  "--plot", str(out)])
    assert r.exit_code == 1
    lines = r.output.splitlines()
    assert any("what the numbers mean:" in ln for ln in lines)  # the table came first
    assert lines[-1] == f"Error: --plot {out}: no chart written (No space left on device); the results are above"


def test_bench_jitter_offers_no_plot():
    r = s3kv("bench", "jitter", "--help")
    assert r.returncode == 0 and "--plot" not in r.stdout
    assert "No such option '--plot'" in _error(s3kv("bench", "jitter", "--plot", "x.png"))


# --------------------------------------------------------------------------- 3: unique demo prefixes


def test_two_demos_on_one_bucket_in_the_same_second_do_not_read_each_other(tmp_path, monkeypatch):
    """With the clock frozen (both started in one second), the second run's cold cluster still
    starts cold: its figures are the first run's, not a warm cluster's."""
    import s3kv.tools.demo as demo

    monkeypatch.setattr(demo.time, "time", lambda: 1_800_000_000.0)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    for k in [k for k in os.environ if k.startswith("S3KV_")]:
        monkeypatch.delenv(k)
    url = f"file://{tmp_path}/kv"
    runs = []
    for _ in range(2):
        r = CliRunner().invoke(main, ["demo", "--url", url, "--json", "--keep"])
        assert r.exit_code == 0, r.output
        runs.append(json.loads(r.output[r.output.index("{"):]))
    first, second = runs
    assert first["store_url"] != second["store_url"]
    assert all(re.fullmatch(re.escape(url) + r"/demo-1800000000-[0-9a-f]{6}", x["store_url"]) for x in runs)
    assert second["cold"]["matched_tokens"] == first["cold"]["matched_tokens"] < second["warm"]["matched_tokens"]


def test_two_demos_started_together_keep_their_figures(tmp_path):
    url = f"file://{tmp_path}/kv"
    procs = [subprocess.Popen([sys.executable, "-m", "s3kv.cli", "demo", "--url", url, "--json"], env=_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    docs = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err
        docs.append(json.loads(out))
    assert docs[0]["store_url"] != docs[1]["store_url"]
    assert docs[0]["cold"]["hit_rate"] == docs[1]["cold"]["hit_rate"]
    assert docs[0]["warm"]["hit_rate"] == docs[1]["warm"]["hit_rate"]


# --------------------------------------------------------------------------- 4: Ctrl-C


def _interrupt_demo(*args: str, after: str) -> tuple[subprocess.CompletedProcess[str], list[int]]:
    """Start ``s3kv demo ARGS`` as a terminal would (its own process group), press Ctrl-C (SIGINT to
    the group) once ``after`` is on stderr; return what it printed and every process it had started."""
    import psutil

    p = subprocess.Popen([sys.executable, "-m", "s3kv.cli", "demo", *args], env=_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True, cwd=REPO.parent)
    seen = []
    while True:
        line = p.stderr.readline()  # type: ignore[union-attr]
        seen.append(line)
        if after in line or not line:
            break
    time.sleep(0.3)
    kids = [k.pid for k in psutil.Process(p.pid).children(recursive=True)]
    os.killpg(p.pid, signal.SIGINT)
    out, err = p.communicate(timeout=120)
    return subprocess.CompletedProcess(p.args, p.returncode, out, "".join(seen) + err), kids


def _alive(pids: list[int]) -> list[int]:
    import psutil

    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def test_ctrl_c_in_the_demo_ends_every_child_quietly_and_says_how_to_remove_its_prefix(tmp_path):
    url = f"file://{tmp_path}/kv"
    r, kids = _interrupt_demo("--url", url, after="cluster A done")
    assert r.returncode == 130, r.stderr
    assert kids and not _alive(kids), kids  # cluster B and its helpers are gone
    for word in ("Traceback", "KeyboardInterrupt", "RuntimeError", "Aborted"):
        assert word not in r.stderr, r.stderr
    [line] = [ln for ln in r.stderr.splitlines() if "interrupted" in ln]
    m = re.fullmatch(r"s3kv demo: interrupted; what it wrote stays under (\S+); remove it with: "
                     r"(s3kv gc --url \S+ --older-than 0 --yes)", line)
    assert m, line
    run_url = m.group(1)
    left = json.loads(s3kv("ls", "--url", run_url, "--json").stdout)["total"]["objects"]
    assert left > 0  # cluster A's objects
    gc = s3kv(*m.group(2).split()[1:])
    assert gc.returncode == 0, gc.stderr
    assert json.loads(s3kv("ls", "--url", run_url, "--json").stdout)["total"]["objects"] == 0


@pytest.mark.parametrize("after", ["demo: cluster A (cold)", "cluster A done"])
def test_ctrl_c_with_the_embedded_server_stops_it_and_every_cluster(after):
    r, kids = _interrupt_demo(after=after)
    assert r.returncode == 130 and not _alive(kids), (r.stderr, kids)
    assert [ln for ln in r.stderr.splitlines() if "interrupted" in ln] == ["s3kv demo: interrupted"]
    assert "Traceback" not in r.stderr and "KeyboardInterrupt" not in r.stderr


# --------------------------------------------------------------------------- 5: each warning once, where it applies


def _warnings(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if "warning" in ln.lower()]


@pytest.fixture(scope="module")
def file_demo(tmp_path_factory) -> subprocess.CompletedProcess[str]:
    """``s3kv demo`` on a file:// store, with a setting both clusters override (S3KV_LOAD_MODE=sync)."""
    url = f"file://{tmp_path_factory.mktemp('demo')}/kv"
    return s3kv("demo", "--url", url, env=_env(S3KV_LOAD_MODE="sync"))


def test_a_setting_both_demo_clusters_override_is_said_once(file_demo):
    r = file_demo
    assert r.returncode == 0, r.stderr
    warned = _warnings(r.stderr)
    assert len([w for w in warned if "S3KV_LOAD_MODE=sync" in w]) == 1, warned
    assert len(warned) == len(set(warned)), warned
    # The option that could only be overridden is not offered.
    assert "--load-mode" not in s3kv("demo", "--help").stdout


def test_benches_do_not_warn_about_their_own_made_up_model_store_or_staging():
    for cmd in (["bench", "e2e", "--quick", "--url", "memory://e2e-warn"],
                ["bench", "trace", str(SLICE), "--limit", "6"],
                ["bench", "transfer", "--quick", "--url", "memory://transfer-warn"]):
        r = s3kv(*cmd)
        assert r.returncode == 0, (cmd, r.stderr)
        for text in ("integrity tags are off", "identity is weak", "S3KV_STAGING_MIB"):
            assert text not in r.stderr, (cmd, text, r.stderr)


# --------------------------------------------------------------------------- 6: words


def test_no_exception_class_names_in_errors():
    r = s3kv("size", "--tp", "3")
    line = _error(r)
    assert line == ("Error: Invalid value for --tp: Gemma-3-27B's 16 KV heads do not split over 3 shards; "
                    "use a TP size that divides 16"), line
    from s3kv.tools.options import one_line

    assert one_line(PermissionError(13, "Permission denied", "/ro/p.png")) == "/ro/p.png: Permission denied"
    assert one_line(ValueError("16 KV heads do not split over TP 3")) == "16 KV heads do not split over TP 3"
    assert one_line(KeyError()) == "an unexpected error that says nothing more"


@pytest.mark.parametrize("bad, why", [
    ("s3//x", "expected a URL such as s3://bucket/prefix or file:///path, got 's3//x'"),
    ("s3://x", "bucket name 'x' must be 3 to 63 characters long, got 's3://x'"),
])
def test_url_mistakes_name_the_option_in_every_command(bad, why):
    cmds = [["ls"], ["stats"], ["verify"], ["demo"], ["config"], ["bench", "lookup", "--quick"],
            ["bench", "jitter", "--quick"], ["bench", "e2e", "--quick"], ["bench", "trace", str(SLICE)]]
    for cmd in cmds:
        r = CliRunner().invoke(main, [*cmd, "--url", bad])
        assert r.exit_code == 2, (cmd, r.output)
        assert f"Error: Invalid value for --url: {why}" in r.output, (cmd, r.output)
        assert "S3KV_URL" not in r.output, (cmd, r.output)


def test_token_counts_are_written_the_same_everywhere():
    k = s3kv("size", "--prompt-tokens", "16k", "--json")
    n = s3kv("size", "--prompt-tokens", "16384", "--json")
    assert k.returncode == 0 and k.stdout == n.stdout
    for cmd in (["size", "--prompt-tokens"], ["bench", "lookup", "--quick", "--prompts"]):
        r = CliRunner().invoke(main, [*cmd, "16q"])
        assert r.exit_code == 2 and "'16q' is not a token count" in r.output and "ValueError" not in r.output


def test_bench_faults_help_is_in_the_same_style_as_the_others():
    faults, lookup = s3kv("bench", "faults", "--help"), s3kv("bench", "lookup", "--help")
    for r, name in ((faults, "faults"), (lookup, "lookup")):
        assert r.returncode == 0 and re.match(rf"Usage: .*s3kv.* bench {name} \[OPTIONS\]\n", r.stdout), r.stdout
        assert "\nOptions:\n" in r.stdout and "-h, --help" in r.stdout and "Show this message and exit." in r.stdout
    assert "--failed-load-hook" in faults.stdout and "usage:" not in faults.stdout
    bad = s3kv("bench", "faults", "--faults", "nope")
    assert _error(bad) == ("Error: Invalid value for --faults: unknown: nope; known: 500, 503, latency, none, "
                           "reset, stall, truncate, truncate_head")


def test_a_glossary_linked_from_the_demo_and_help_explains_the_jargon(file_demo):
    from s3kv.tools.glossary import TERMS, markdown

    assert (REPO / "docs" / "glossary.md").read_text() == markdown()
    for word in ("page", "rung", "wave", "mism", "pp", "MFU", "kv_mismatches", "prefill", "hit rate"):
        assert any(word in term for term in TERMS), word
    assert "s3kv glossary (docs/glossary.md)" in " ".join(s3kv("--help").stdout.split())
    r = s3kv("glossary", "rung")
    assert r.returncode == 0 and r.stdout.startswith("failed load, rung: ")
    demo = file_demo
    assert demo.returncode == 0, demo.stderr
    assert demo.stdout.splitlines()[-1].endswith("s3kv glossary (docs/glossary.md)")
    # "served from S3" only where the store is S3.
    assert "served from the store" in demo.stdout and "served from S3" not in demo.stdout


# --------------------------------------------------------------------------- 8: the docs agree


def _readme_row(start: str) -> str:
    return next(ln for ln in (REPO / "README.md").read_text().splitlines() if ln.startswith(f"| {start}"))


def test_the_docs_quote_the_same_figures():
    bench = (REPO / "docs" / "benchmarks.md").read_text()
    demo = re.search(r"warm cluster: ([\d–]+%) of prompt tokens", _readme_row("warm cluster")).group(1)
    headline = bench.split("## The demo", 1)[1].split("\n\n")[2]
    assert headline.startswith(f"{demo} of prompt tokens served from S3"), (demo, headline)
    ratio = re.search(r"S3 bill ([\d.]+)× (?:the )?GPU (?:time )?saved", _readme_row("Mooncake trace")).group(1)
    trace = bench.split("## Trace replay", 1)[1].split("\n\n")[2]
    assert f"value ratio {ratio}" in trace, (ratio, trace)
    sizing = (REPO / "docs" / "sizing.md").read_text()
    assert re.findall(r"Ratio at 1 h[^:]*: \*\*([\d.]+)\*\*", sizing) == [ratio]


def test_one_placeholder_aws_account():
    texts = [p.read_text() for p in [*REPO.glob("docs/*.md"), *REPO.glob("infra/**/*.tf"), *REPO.glob("infra/**/*.md"),
                                     REPO / "README.md"]]
    accounts = {a for t in texts for a in re.findall(r"arn:aws:iam::(\d{12}):", t)}
    assert accounts == {"111122223333"}, accounts


def test_the_readme_says_up_front_that_tensorrt_llm_needs_a_gpu():
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Use it with TensorRT-LLM", 1)[1].lstrip()
    assert section.startswith("This needs an NVIDIA GPU and TensorRT-LLM"), section[:80]
    assert len(readme.splitlines()) <= 103


def test_the_readme_python_line_gives_the_llm_what_the_options_file_gives_trtllm_serve(monkeypatch):
    """The README's block, run against a stand-in for TensorRT-LLM's LLM that records its keyword
    arguments: the connector classes and the kv_cache_config flags of the options file, plus its own."""
    import types

    import yaml

    seen: dict = {}
    fake = types.ModuleType("tensorrt_llm")
    fake.LLM = lambda **kw: seen.update(kw)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tensorrt_llm", fake)
    readme = (REPO / "README.md").read_text()
    [block] = re.findall(r"```python\n(.*?)```", readme, re.S)
    exec(compile(block, "README.md", "exec"), {})
    options = yaml.safe_load((REPO / "examples" / "extra-llm-api-options.yaml").read_text())
    assert seen["model"] == "google/gemma-3-27b-it"
    assert seen["kv_connector_config"] == options["kv_connector_config"]
    assert seen["kv_cache_config"] == {**options["kv_cache_config"], "max_attention_window": [1024] * 5 + [32768]}
