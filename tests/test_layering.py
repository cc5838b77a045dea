"""The package layout is the design (docs/architecture.md): layers import only downwards, the core
is pure, big modules say why they are one module, and the architecture page (its diagram and its
Layout block) names the tree as it is.

Imports are read from the source (every ``import`` / ``from`` statement of every module, also
inside functions and ``TYPE_CHECKING`` blocks), not from ``sys.modules``: the standard library
imports ``threading`` for itself, so only the source says what a module asks for.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "s3kv"

#: Layers, lowest first: a module may import s3kv modules of its own layer or a lower one.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("core", ("s3kv.core", "s3kv.config")),
    ("store", ("s3kv.store",)),
    ("transfer", ("s3kv.transfer",)),
    ("engine", ("s3kv.engine",)),
    ("trtllm", ("s3kv.trtllm",)),
    ("sim", ("s3kv.sim",)),
    ("tools", ("s3kv.tools", "s3kv.cli")),
]

#: What the pure core never asks for: network clients, threads and processes, CUDA (or torch at all).
IMPURE = {
    "boto3", "botocore", "obstore", "fsspec", "s3fs", "urllib3", "requests", "socket", "http", "urllib.request",
    "threading", "_thread", "concurrent", "concurrent.futures", "multiprocessing", "subprocess", "asyncio", "queue",
    "prometheus_client", "torch", "torch.cuda",
}

#: Modules longer than this say at the top why they are one module.
MAX_LINES = 400
REASON = "Why this is one module:"


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _layer(module: str) -> int:
    if module == "s3kv":
        return 0
    for rank, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    raise LookupError(f"{module} is in no layer: add it to LAYERS (and to docs/architecture.md)")


def _imports(module: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import statement of ``module``."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.append((node.lineno, name))
            # ``from pkg import submodule`` imports that submodule too.
            for a in node.names:
                if f"{name}.{a.name}" in MODULES:
                    out.append((node.lineno, f"{name}.{a.name}"))
    return out


def test_every_module_has_a_layer():
    for module in MODULES:
        _layer(module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_only_go_down(module):
    mine = _layer(module)
    up = [
        f"line {line}: {name} ({LAYERS[_layer(name)][0]})"
        for line, name in _imports(module)
        if (name == "s3kv" or name.startswith("s3kv.")) and _layer(name) > mine
    ]
    assert not up, f"{module} ({LAYERS[mine][0]}) imports a higher layer: " + "; ".join(up)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _layer(m) == 0))
def test_the_core_is_pure(module):
    bad = [
        f"line {line}: {name}"
        for line, name in _imports(module)
        if name in IMPURE or name.split(".")[0] in IMPURE
    ]
    assert not bad, f"{module} is in the pure core but imports " + "; ".join(bad)


def test_the_layering_test_can_fail(tmp_path, monkeypatch):
    """A core module that imports the store, or threads, is caught."""
    monkeypatch.setitem(MODULES, "s3kv.core.fake", tmp_path / "fake.py")
    (tmp_path / "fake.py").write_text("import threading\nfrom ..store.base import ObjectStore\n")
    with pytest.raises(AssertionError, match="s3kv.store.base"):
        test_imports_only_go_down("s3kv.core.fake")
    with pytest.raises(AssertionError, match="threading"):
        test_the_core_is_pure("s3kv.core.fake")


@pytest.mark.parametrize("module", sorted(MODULES))
def test_big_modules_say_why_they_are_one_module(module):
    path = MODULES[module]
    lines = len(path.read_text().splitlines())
    if lines <= MAX_LINES:
        return
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    assert REASON in doc, (
        f"{path.relative_to(REPO)} has {lines} lines: split it along its seams, or say at the top "
        f"'{REASON} ...'"
    )


# --------------------------------------------------------------------------- the docs name the tree


def _packages() -> list[str]:
    """Every package under s3kv/, as a path relative to the repository (``s3kv/engine/leader/``)."""
    return sorted(f"{p.parent.relative_to(REPO).as_posix()}/" for p in PKG.rglob("__init__.py"))


def _layout_block() -> str:
    """The code block of docs/architecture.md's Layout section (the README links there)."""
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text.split("\n## Layout", 1)[1].split("\n## ", 1)[0]
    return section.split("```", 2)[1].split("\n", 1)[1]  # past the fence's info string


def _layout_entries() -> tuple[set[str], set[str]]:
    """(directories, files) the layout block names, as repository paths.

    A line whose first word ends in ``/`` names a directory (below ``s3kv/`` when indented);
    every ``*.py`` word belongs to the latest directory named.
    """
    dirs: set[str] = set()
    files: set[str] = set()
    current = ""
    for line in _layout_block().splitlines():
        words = line.split()
        if not words:
            continue
        indented = line[0].isspace()
        if words[0].endswith("/"):
            current = ("s3kv/" if indented else "") + words[0]
            if not indented:
                dirs.update(w for w in words if w.endswith("/"))
            dirs.add(current)
        for w in words:
            if re.fullmatch(r"[\w]+\.py", w):
                files.add(current + w)
    return dirs, files


def test_layout_block_names_real_paths():
    dirs, files = _layout_entries()
    assert files, "no module named in the architecture page's layout block"
    missing = sorted(p for p in dirs | files if not (REPO / p).exists())
    assert not missing, f"the architecture page's layout names what does not exist: {missing}"


def test_layout_block_names_every_package():
    dirs, _ = _layout_entries()
    unnamed = [p for p in _packages() if p not in dirs]
    assert not unnamed, f"packages missing from the architecture page's layout: {unnamed}"


def test_architecture_page_names_real_modules_and_every_package():
    text = (REPO / "docs" / "architecture.md").read_text()
    paths = set(re.findall(r"\bs3kv/[\w/]*(?:\.py|/)", text))
    assert paths
    missing = sorted(p for p in paths if not (REPO / p).exists())
    assert not missing, f"docs/architecture.md names what does not exist: {missing}"
    for dotted in set(re.findall(r"`(s3kv(?:\.\w+)+)`", text)):
        assert importlib.util.find_spec(dotted) is not None, dotted
    unnamed = [p for p in _packages() if p not in paths and p != "s3kv/"]
    assert not unnamed, f"packages docs/architecture.md does not name: {unnamed}"


def test_the_docs_check_can_fail(monkeypatch):
    """A module the layout block names that does not exist, and a package it leaves out, are caught."""
    block = _layout_block()
    monkeypatch.setattr(
        sys.modules[__name__], "_layout_block",
        lambda: block.replace("engine/worker/", "engine/workers/").replace("rank.py", "ranks.py"),
    )
    with pytest.raises(AssertionError, match="ranks.py"):
        test_layout_block_names_real_paths()
    with pytest.raises(AssertionError, match="s3kv/engine/worker/"):
        test_layout_block_names_every_package()


# --------------------------------------------------------------------------- what users import


def test_public_surfaces_import_as_users_import_them():
    """A fresh interpreter, the way TensorRT-LLM (``connector_module="s3kv.trtllm"``), the console
    script (``s3kv = "s3kv.cli:main"``) and ``python -m`` reach s3kv -- nothing else imported first."""
    import subprocess
    import sys as _sys

    script = (
        "import importlib, importlib.util, tomllib\n"
        "m = importlib.import_module('s3kv.trtllm')\n"
        "from s3kv.trtllm.api import KvCacheConnectorScheduler, KvCacheConnectorWorker\n"
        "assert issubclass(getattr(m, 'S3KvConnectorLeader'), KvCacheConnectorScheduler)\n"
        "assert issubclass(getattr(m, 'S3KvConnectorWorker'), KvCacheConnectorWorker)\n"
        "target = tomllib.load(open('pyproject.toml', 'rb'))['project']['scripts']['s3kv']\n"
        "mod, _, attr = target.partition(':')\n"
        "assert callable(getattr(importlib.import_module(mod), attr))\n"
        "for name in ('s3kv.cli', 's3kv.tools.demo', 's3kv.tools.faultmatrix'):\n"
        "    assert importlib.util.find_spec(name) is not None, name\n"
    )
    if _sys.version_info < (3, 11):
        pytest.skip("tomllib needs Python 3.11")
    r = subprocess.run([_sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
