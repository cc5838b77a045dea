"""The README as a newcomer reads it (issues 33.7, 33.8, 32.5): a Measured section that fits on a
screen and whose every row is an ``s3kv`` command that exists, no words only this project's
sessions understand, one install name that is really s3kv's, and the TensorRT-LLM lines table
naming the import paths s3kv really tries."""

from __future__ import annotations

import re
from pathlib import Path

from click.testing import CliRunner

from s3kv.cli import main

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
#: What the project's own sessions say that a user cannot check.
JARGON = ("this workplace", "issue #17", "of #17", "~2026-09", "merged around", "merged line ~")


def _section(title: str) -> str:
    start = README.index(f"## {title}")
    end = README.find("\n## ", start + 1)
    return README[start:end]


def _rows(section: str) -> list[list[str]]:
    lines = [ln for ln in section.splitlines() if ln.startswith("| ") and not ln.startswith("| ---")]
    return [[c.strip() for c in ln.strip().strip("|").split(" | ")] for ln in lines[1:]]


def test_measured_fits_on_one_screen_and_every_row_is_an_s3kv_command():
    section = _section("Measured")
    lines = section.splitlines()
    assert len(lines) <= 30 and max(map(len, lines)) <= 160, (len(lines), max(map(len, lines)))
    rows = _rows(section)
    assert len(rows) >= 8
    for figure, command, where in rows:
        assert len(figure.split()) <= 20 and where, figure
        cmd = re.match(r"`(s3kv [^`]+)`", command)
        assert cmd, f"not an s3kv command: {command}"
        words = [w for w in cmd.group(1).split()[1:] if not w.startswith("-") and w.isidentifier()][:2]
        r = CliRunner().invoke(main, [*words[: 2 if words[0] == "bench" else 1], "--help"])
        assert r.exit_code == 0 and "usage" in r.output.lower(), (command, r.output)
    # Where the full trace comes from, and which rows need a GPU.
    assert "tests/fixtures/mooncake_slice.jsonl" in section and (REPO / "tests/fixtures/mooncake_slice.jsonl").exists()
    assert "kvcache-ai/Mooncake" in section and "`s3kv bench staging` (GPU)" in section
    assert "prints \"skipped\" and exits 0 without one" in section
    assert "[docs/benchmarks.md](docs/benchmarks.md)" in section and (REPO / "docs/benchmarks.md").exists()


def test_no_session_jargon_for_outsiders():
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    for page in pages:
        if page.name in ("failures.md", "benchmarks.md"):
            continue  # failures.md: another area's page this session; benchmarks.md quotes history
        text = page.read_text()
        for word in JARGON:
            assert word not in text, f"{page.name}: {word!r}"
    from s3kv.trtllm import boundary

    assert "2026-09" not in Path(boundary.__file__).read_text()


def test_one_install_name_and_it_is_ours():
    toml = (REPO / "pyproject.toml").read_text()
    assert re.search(r'^name = "s3kv-trtllm"$', toml, re.M)
    assert re.search(r'^s3kv = "s3kv.cli:run"$', toml, re.M)  # the command stays s3kv
    wrong = re.compile(r"pip install (?:-\S+ )*['\"]?s3kv(?:\[|['\"\s`]|$)")
    for path in [REPO / "README.md", *REPO.glob("docs/*.md"), *REPO.glob("examples/*.py"),
                 *REPO.glob("s3kv/**/*.py")]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            assert not wrong.search(line), f"{path.relative_to(REPO)}:{n} installs PyPI's unrelated s3kv: {line}"
    assert "pip install s3kv-trtllm" in README


def test_readme_test_command_is_the_ci_command():
    ci = (REPO / ".ci" / "run").read_text()
    [readme_cmd] = [ln for ln in README.splitlines() if "pip install -q -c constraints/cpu.txt -e '.[test]'" in ln]
    assert readme_cmd in ci.splitlines()


def test_trtllm_lines_table_names_the_paths_and_features_s3kv_detects():
    from s3kv.trtllm import api

    section = _section("Use it with TensorRT-LLM")
    rows = _rows(section[section.index("### Which TensorRT-LLM"):])
    assert [r[0].split(":")[0] for r in rows] == ["flat API (PyPI 1.2.x)", "layout line", "with the failure path"]
    source = Path(api.__file__).read_text()
    prefix = "tensorrt_llm._torch.pyexecutor."
    for module in ("kv_cache_connector", "connectors.kv_cache_connector", "connectors.kv_cache_layout"):
        assert f"`{module}`" in section and f"{prefix}{module}" in source, module
    assert "`take_failed_load_request_ids`" in rows[2][0] and "take_failed_load_request_ids" in source


def test_version_says_which_trtllm_line_it_detects(monkeypatch):
    from s3kv.tools.cli import engine_line
    from s3kv.trtllm import api

    r = CliRunner().invoke(main, ["--version"])
    assert r.exit_code == 0 and r.output.splitlines()[0].startswith("s3kv, version ")
    if not api.HAVE_TRTLLM:
        assert r.output.splitlines()[1] == (
            "TensorRT-LLM: not installed (s3kv's simulator uses stand-ins for its connector classes)"
        )

    class Worker:  # the base classes of the newest flat-API line: they have the failure path
        __module__ = "tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector"

        def take_failed_load_request_ids(self) -> set[int]:
            return set()

        def try_abort_request(self, request_id: int) -> bool:
            return True

    class Scheduler:
        def try_abort_request(self, request_id: int, reason: str) -> None:
            pass

    monkeypatch.setattr(api, "HAVE_TRTLLM", True)
    monkeypatch.setattr(api, "HAVE_TRTLLM_LAYOUT", False)
    monkeypatch.setattr(api, "KvCacheConnectorWorker", Worker)
    monkeypatch.setattr(api, "KvCacheConnectorScheduler", Scheduler)
    line = engine_line()
    assert "flat API (register_kv_caches: one KV pool)" in line
    assert "connector classes from tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector" in line
    assert line.endswith("failed-load path (take_failed_load_request_ids): yes")
