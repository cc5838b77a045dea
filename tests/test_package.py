"""The package as another project gets it (issue 40.1): docs/install.md's commands build a wheel
from a clone, install it into a fresh virtual environment, and ``import s3kv.trtllm`` works there;
the release workflow builds, tests and publishes it on a tag by trusted publishing.

Kept offline and fast (about 10 s): the wheel is built with the build tools already installed
(``--no-build-isolation``, where the page's command lets pip fetch them), and installed without
its dependencies (``--no-deps``; the fresh environment sees the ones this interpreter has through
a ``.pth`` file, after its own site-packages). Everything else runs as the page writes it.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import sysconfig
from pathlib import Path

import pytest
import yaml
from docshell import REPO, DocShell, shell_blocks

PAGE = REPO / "docs" / "install.md"
WHEEL = "s3kv_trtllm-0.1.0-py3-none-any.whl"


def _clone(dest: Path) -> Path:
    """What a clone holds for a build: the package, its metadata and README."""
    dest.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, dest / name)
    shutil.copytree(REPO / "s3kv", dest / "s3kv", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


def test_the_documented_wheel_installs_in_a_fresh_venv_and_imports_s3kv_trtllm(tmp_path):
    version = re.search(r'^version = "([^"]+)"$', (REPO / "pyproject.toml").read_text(), re.M)
    assert version and WHEEL == f"s3kv_trtllm-{version.group(1)}-py3-none-any.whl"
    clone = _clone(tmp_path / "s3kv")
    [block] = shell_blocks(PAGE)
    deps = sysconfig.get_paths()["purelib"]
    pth = f"../app/lib/python{sys.version_info.major}.{sys.version_info.minor}/site-packages/zz-deps.pth"
    shell = DocShell(clone, {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                             "HOME": str(tmp_path), "LANG": "C.UTF-8"}, {
        "pip wheel --no-deps ": "pip wheel --no-deps --no-build-isolation ",
        "python -m venv ../app\n": f"python -m venv ../app\necho {deps} > {pth}\n",
        "/bin/pip install dist/": "/bin/pip install --no-deps dist/",
    })
    out = shell.run(block, timeout=300)
    assert (clone / "dist" / WHEEL).exists()
    assert out.stdout.strip().splitlines()[-1] == ("{'connector_module': 's3kv.trtllm', 'connector_scheduler_class': "
                                  "'S3KvConnectorLeader', 'connector_worker_class': 'S3KvConnectorWorker'}")
    # The import came from the fresh environment's copy, not from a checkout or this interpreter's.
    app = tmp_path / "app"
    code = "import s3kv.trtllm, s3kv.tools.bench.cli, s3kv.sim; print(s3kv.__file__)"
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path)}
    import subprocess

    where = subprocess.run([str(app / "bin" / "python"), "-c", code], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=120)
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(app), where.stdout
    version_out = subprocess.run([str(app / "bin" / "s3kv"), "--version"], cwd=tmp_path, env=env,
                                 capture_output=True, text=True, timeout=120)
    assert version_out.returncode == 0 and version_out.stdout.startswith(f"s3kv, version {version.group(1)}")


def test_no_doc_sends_users_to_a_release_that_is_not_published():
    """`pip install s3kv-trtllm` fails until a release exists: every place that names it says so,
    and the README gives a command that works today."""
    pages = [REPO / "README.md", *REPO.glob("docs/*.md"), *REPO.glob("examples/*"), *REPO.glob("s3kv/**/*.py")]
    for path in pages:
        text = path.read_text()
        for m in re.finditer(r"pip install [\"']?s3kv-trtllm", text):
            around = text[max(0, m.start() - 200):m.end() + 200]
            assert "published" in around, (path.relative_to(REPO), around)
    readme = (REPO / "README.md").read_text()
    assert "pip install /path/to/s3kv" in readme and "[docs/install.md](docs/install.md)" in readme


def _workflow(name: str) -> dict:
    doc = yaml.safe_load((REPO / ".github" / "workflows" / name).read_text())
    doc["on"] = doc.pop(True, doc.get("on"))  # YAML 1.1 reads the key `on` as true
    return doc


def _runs(job: dict) -> str:
    return "\n".join(s.get("run", "") for s in job["steps"])


def test_the_release_workflow_builds_tests_and_publishes_on_a_tag_by_trusted_publishing():
    wf = _workflow("release.yml")
    assert wf["on"]["push"]["tags"] == ["v*"]
    jobs = wf["jobs"]
    build, smoke, publish = jobs["build"], jobs["test"], jobs["publish"]
    assert "python -m build" in _runs(build) and "pyproject.toml" in _runs(build)  # the tag matches the version
    assert any(s.get("uses", "").startswith("actions/upload-artifact") for s in build["steps"])
    assert smoke["needs"] == "build"
    assert "python -m venv" in _runs(smoke) and 'import s3kv.trtllm' in _runs(smoke) and "s3kv demo" in _runs(smoke)
    assert publish["needs"] == ["build", "test"] and publish["environment"]["name"] == "pypi"
    assert publish["permissions"] == {"id-token": "write"}
    [step] = [s for s in publish["steps"] if "uses" in s and "pypi-publish" in s["uses"]]
    assert step["uses"].startswith("pypa/gh-action-pypi-publish@") and "password" not in step.get("with", {})
    assert wf.get("permissions") == {"contents": "read"}  # only the publish job gets an OIDC token


def test_ci_builds_the_wheel_and_imports_it_in_a_fresh_venv():
    job = _workflow("ci.yml")["jobs"]["package"]
    runs = _runs(job)
    assert "python -m build" in runs and "python -m venv" in runs
    assert re.search(r"pip install .*dist/\*\.whl", runs) and 'python -c "import s3kv.trtllm"' in runs


@pytest.mark.parametrize("name", ["ci.yml", "release.yml"])
def test_workflows_parse(name):
    assert _workflow(name)["jobs"]
