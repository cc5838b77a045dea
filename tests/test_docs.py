"""The user docs (docs/*.md) render, link only to files that exist, and every command in them runs.

Every ``bash`` block of every page is run here as a reader would paste it (``docshell``), against
a local store, except the Terraform walkthrough of ``s3-compatible.md``, which
``tests/test_terraform.py`` runs against SeaweedFS with authentication. Blocks marked as output
must match the command's stdout exactly. Settings, metrics and PromQL named in the docs must be
real, and the real ones must be documented.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from docshell import REPO, DocShell, blocks, shell_blocks

DOCS = REPO / "docs"
#: Pages other people write (docs/failures.md, docs/security.md): linked to from here; they may
#: arrive in another branch.
ELSEWHERE = {"failures.md", "security.md", "trace-replay.md"}
#: Pages whose shell blocks another test runs, and which test.
RUN_ELSEWHERE = {
    "s3-compatible.md": "tests/test_terraform.py::test_walkthrough_on_seaweedfs_with_auth",
    "install.md": "tests/test_package.py::test_the_documented_wheel_installs_in_a_fresh_venv_and_imports_s3kv_trtllm",
}
MINE = [
    "README.md", "getting-started.md", "configuration.md", "operations.md", "sizing.md",
    "metrics.md", "kubernetes.md", "s3-compatible.md", "architecture.md", "benchmarks.md",
    "trtllm-serve.md", "cli.md", "install.md", "glossary.md",
]


def _env(tmp: Path) -> dict[str, str]:
    return {
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(REPO),
        "HOME": str(tmp),
        "AWS_EC2_METADATA_DISABLED": "true",
        "LANG": "C.UTF-8",
    }


def _sandbox(tmp: Path) -> Path:
    box = tmp / "repo"
    for sub in ("infra", "examples"):
        shutil.copytree(REPO / sub, box / sub, ignore=shutil.ignore_patterns(".terraform*", "*.tfstate*"))
    return box


# --------------------------------------------------------------------------- every page


def test_every_page_is_known_and_has_a_runner():
    pages = sorted(p.name for p in DOCS.glob("*.md"))
    mine = set(MINE) | {"reliability.md"} | ELSEWHERE
    assert set(pages) <= mine, f"new page(s) {set(pages) - mine}: add them to MINE and run their commands"
    for name in MINE:
        assert (DOCS / name).exists(), name


@pytest.mark.parametrize("name", MINE)
def test_links_resolve_and_fences_close(name):
    text = (DOCS / name).read_text()
    assert text.count("```") % 2 == 0, "an unclosed code fence"
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if re.match(r"^[a-z]+://", target):
            continue
        path = (DOCS / target).resolve()
        if target in ELSEWHERE and not path.exists():
            continue
        assert path.exists(), f"{name} links to missing {target}"
        assert REPO in path.parents, f"{name} links outside the repository: {target}"


# --------------------------------------------------------------------------- getting-started.md


def test_getting_started_commands(tmp_path):
    page = DOCS / "getting-started.md"
    sh = shell_blocks(page)
    box = _sandbox(tmp_path)
    shell = DocShell(box, _env(tmp_path), {"/tmp/s3kv.env": str(tmp_path / "s3kv.env")})
    try:
        outputs = []
        for b in sh:
            if "background" in b.marks:
                shell.start(b, ready="Press Ctrl-C")
            else:
                outputs.append(shell.run(b, timeout=600))
    finally:
        shell.stop()
    demo, look = outputs
    assert "kv_mismatches: 0" in demo.stdout and "warm cluster B:" in demo.stdout
    assert "kept; look with: s3kv ls --url s3://s3kv/kv/demo-" in look.stdout
    assert re.search(r"^demo-\d+-[0-9a-f]{6}/[0-9a-f]{32}\s", look.stdout, re.M), look.stdout  # ls at the parent
    assert re.search(r"checked \d+ objects: \d+ ok, 0 bad", look.stdout), look.stdout


# --------------------------------------------------------------------------- configuration.md


def test_configuration_commands_and_file(tmp_path):
    import yaml

    page = DOCS / "configuration.md"
    settings_file = next(b for b in blocks(page) if b.lang == "yaml")
    shown = next(b for b in blocks(page) if b.lang == "text" and b.text.startswith("SETTING"))
    box = _sandbox(tmp_path)
    cache = f"file://{tmp_path}/cache"
    (tmp_path / "cache").mkdir()  # an existing, empty cache (ls refuses a directory that is not there)
    (box / "s3kv.yaml").write_text(settings_file.text.replace("s3://my-bucket/kv", cache))
    # The file the page shows loads as it says (with its bucket swapped for a directory).
    from s3kv.config import load_settings

    s = load_settings({"S3KV_CONFIG_FILE": str(box / "s3kv.yaml")})
    assert (s.url, s.staging_mib, s.checkpoint_tokens, s.metrics_port) == (cache, 2048, 8192, 9400)
    assert yaml.safe_load(settings_file.text)["s3kv"]["url"] == "s3://my-bucket/kv"
    shell = DocShell(box, _env(tmp_path))
    [b] = shell_blocks(page)
    out = shell.run(b).stdout.splitlines()
    assert out[-1] == f"no s3kv objects under {cache}"
    # What the page says `s3kv config` prints, column widths aside (the bucket is a directory here).
    table = [ln.split() for ln in out[out.index(next(ln for ln in out if ln.startswith("SETTING"))):-2]]
    assert table == [ln.replace("s3://my-bucket/kv", cache).split() for ln in shown.text.splitlines()], out
    assert out[0] == f"settings file: {box / 's3kv.yaml'} (S3KV_CONFIG_FILE)"
    assert out[1].startswith("precedence: command-line flag (--url) > environment (S3KV_<NAME>) > settings file")


def test_configuration_documents_every_setting_and_no_other():
    from s3kv.config import OTHER_ENV_VARS, Settings

    text = (DOCS / "configuration.md").read_text()
    table = set(re.findall(r"^\| `(S3KV_[A-Z0-9_]+)` \|", text, re.M))
    assert table == {"S3KV_" + f.name.upper() for f in dataclasses.fields(Settings)}
    named = set(re.findall(r"S3KV_[A-Z0-9_]+", text))
    user_facing_other = {"S3KV_CONFIG_FILE", "S3KV_LOG_LEVEL", "S3KV_DEBUG", "S3KV_WEED"}
    assert named - table <= user_facing_other | {"S3KV_STAGING_MB"}  # the typo in the warning example
    assert user_facing_other <= OTHER_ENV_VARS


# --------------------------------------------------------------------------- operations.md


def test_operations_commands(tmp_path):
    box = _sandbox(tmp_path)
    url = f"file://{tmp_path}/cache"
    env = {**_env(tmp_path), "S3KV_URL": url}
    subprocess.run([sys.executable, "-m", "s3kv.cli", "demo", "--url", url, "--keep"], env=env, check=True,
                   capture_output=True, timeout=600)
    shell = DocShell(box, env)
    look, check, clean = (shell.run(b) for b in shell_blocks(DOCS / "operations.md"))
    assert re.search(r"^demo-\d+-[0-9a-f]{6}/[0-9a-f]{32}\s", look.stdout, re.M) and "PAGES" in look.stdout
    assert "0 bad" in check.stdout and "deleted 0 bad objects" in check.stdout
    assert "would delete 0 objects" in clean.stdout and "deleted 0 objects" in clean.stdout


# --------------------------------------------------------------------------- sizing.md


def test_sizing_commands_print_what_the_page_shows(tmp_path):
    page = DOCS / "sizing.md"
    bs = blocks(page)
    shell = DocShell(_sandbox(tmp_path), _env(tmp_path))
    checked = 0
    for i, b in enumerate(bs):
        if b.lang != "bash":
            continue
        out = shell.run(b)
        if "output" in b.marks:
            shown = bs[i + 1]
            assert shown.lang == "text"
            assert out.stdout == shown.text, f"docs/sizing.md line {shown.line} differs from the command's output"
            checked += 1
    assert checked == 2


# --------------------------------------------------------------------------- metrics.md, grafana


def _metric_families() -> dict[str, str]:
    from s3kv.engine.metrics import Metrics

    return {fam.name: fam.type for fam in Metrics().registry.collect()}


def _exposed(name: str, kind: str) -> list[str]:
    if kind == "counter":
        return [f"{name}_total"]
    if kind == "histogram":
        return [f"{name}_bucket", f"{name}_sum", f"{name}_count", name]
    return [name]


def _names_in(expr: str) -> set[str]:
    return set(re.findall(r"\bs3kv_[a-z0-9_]+", expr))


def test_metrics_reference_matches_the_registry():
    fams = _metric_families()
    text = (DOCS / "metrics.md").read_text()
    rows = dict(re.findall(r"^\| `(s3kv_[a-z0-9_]+)` \| (\w+) \|", text, re.M))
    documented = {}
    for name, kind in rows.items():
        base = name[: -len("_total")] if kind == "counter" else name
        documented[base] = kind
    assert documented == fams


def test_promql_and_dashboard_name_real_metrics():
    fams = _metric_families()
    real = {n for name, kind in fams.items() for n in _exposed(name, kind)}
    exprs = [b.text.strip() for b in blocks(DOCS / "metrics.md") if b.lang == "promql"]
    dash = json.loads((DOCS / "grafana" / "s3kv.json").read_text())
    exprs += [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 20
    for e in exprs:
        assert _names_in(e) and _names_in(e) <= real, e
        assert e.count("(") == e.count(")") and e.count("[") == e.count("]"), e
    assert any("s3kv_prompt_tokens_total" in e and "s3kv_hit_tokens_total" in e for e in exprs)
    assert {p["datasource"]["uid"] for p in dash["panels"]} == {"${datasource}"}


# --------------------------------------------------------------------------- kubernetes.md


def test_kubernetes_manifests_parse_and_name_real_settings(tmp_path):
    import yaml

    from s3kv.config import OTHER_ENV_VARS, Settings

    known = {"S3KV_" + f.name.upper() for f in dataclasses.fields(Settings)} | OTHER_ENV_VARS
    docs = [d for b in blocks(DOCS / "kubernetes.md") if b.lang == "yaml" for d in yaml.safe_load_all(b.text)]
    kinds = [d.get("kind") for d in docs if "kind" in d]
    assert kinds == ["ServiceAccount", "ConfigMap", "Deployment", "ServiceAccount", "CronJob"]
    deploy = docs[2]
    [container] = deploy["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert {n for n in env if n.startswith("S3KV_")} <= known
    from s3kv.config import load_settings

    # The values are valid settings too (the mounted Secret: a file holding a key here).
    assert env["S3KV_INTEGRITY_KEY_FILE"].startswith(container["volumeMounts"][-1]["mountPath"])
    (tmp_path / "key").write_text("0123456789abcdef" * 4)
    s = load_settings({**env, "S3KV_INTEGRITY_KEY_FILE": str(tmp_path / "key")})
    ports = sorted(p["containerPort"] for p in container["ports"])
    assert ports == [s.metrics_port + r for r in range(2)] and s.metrics_addr == "0.0.0.0"
    options = yaml.safe_load(docs[1]["data"]["extra-llm-api-options.yaml"])
    assert options["kv_connector_config"]["connector_module"] == "s3kv.trtllm"
    scrape = docs[3]["scrape_configs"][0]
    assert re.fullmatch(scrape["relabel_configs"][0]["regex"], "s3kv-rank1")
    # The retention CronJob: one `s3kv gc --expired` pass, valid settings, the gc's own account.
    cron = docs[5]["spec"]
    pod = cron["jobTemplate"]["spec"]["template"]["spec"]
    [gc] = pod["containers"]
    assert gc["args"][:3] == ["s3kv", "gc", "--expired"] and pod["serviceAccountName"] == docs[4]["metadata"]["name"]
    gc_env = {e["name"]: e["value"] for e in gc["env"]}
    assert load_settings(gc_env).retention_h == 1.0 and cron["concurrencyPolicy"] == "Forbid"


@pytest.mark.skipif(shutil.which("terraform") is None, reason="terraform not on PATH")
def test_kubernetes_terraform_validates(tmp_path):
    from test_terraform import Terraform, _cli_config

    [hcl] = [b for b in blocks(DOCS / "kubernetes.md") if b.lang == "hcl"]
    root = tmp_path / "irsa"
    shutil.copytree(REPO / "infra", root / "infra", ignore=shutil.ignore_patterns(".terraform*"))
    (root / "main.tf").write_text(hcl.text)
    tf = Terraform(root, _cli_config(tmp_path / "cli.tfrc"), endpoint="unused")
    tf.run("init", "-input=false", "-no-color", "-backend=false", timeout=300)
    tf.run("validate", "-no-color")
    fmt = tf.run("fmt", "-check", "-no-color", "main.tf", check=False)
    assert fmt.returncode == 0, "the page's HCL is not terraform-fmt formatted"


# --------------------------------------------------------------------------- coverage


def test_every_shell_block_is_run_somewhere():
    run_here = {"getting-started.md", "configuration.md", "operations.md", "sizing.md"}
    for name in MINE:
        if shell_blocks(DOCS / name):
            assert name in run_here or name in RUN_ELSEWHERE, f"{name} has commands no test runs"
    for where in RUN_ELSEWHERE.values():
        path, _, func = where.partition("::")
        assert f"def {func}(" in (REPO / path).read_text(), where
