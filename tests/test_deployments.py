"""The deployments the docs show, run through s3kv's own bring-up (issue 32.6): the Kubernetes
manifest (docs/kubernetes.md) and the ``trtllm-serve`` quickstart (docs/trtllm-serve.md).

Each page's ``extra-llm-api-options`` YAML is parsed and becomes the llm_args the engine would
build (TensorRT-LLM's defaults where the file says nothing: the overlap scheduler on, attention
DP off), the page's environment becomes the settings, and the connector classes the YAML names
are imported and constructed by the simulated engine: the constructors' engine checks, the
settings' validation, the store's access check and the layout check at registration all run.
Then the quickstart's flow: one request on a first engine, a second request sharing its prefix
on a fresh engine, and the metric lines the page greps show the hit.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from pathlib import Path

import pytest
import yaml
from docshell import blocks  # noqa: E402

from s3kv.config import load_settings  # noqa: E402
from s3kv.trtllm.boundary import ConnectorSide, UnsupportedEngine  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
#: The llm_args fields these pages may set, with TensorRT-LLM's defaults for those they leave out
#: (../shared/trtllm-connector-api.md; upstream's TorchLlmArgs).
ENGINE_DEFAULTS = {"disable_overlap_scheduler": False, "enable_attention_dp": False}
KV_CACHE_FIELDS = {"enable_block_reuse", "use_kv_cache_manager_v2", "enable_partial_reuse", "max_attention_window"}
CONNECTOR_FIELDS = {"connector_module", "connector_scheduler_class", "connector_worker_class"}


def _kubernetes() -> tuple[dict, dict[str, str]]:
    docs = [d for b in blocks(DOCS / "kubernetes.md") if b.lang == "yaml" for d in yaml.safe_load_all(b.text)]
    config = next(d for d in docs if d.get("kind") == "ConfigMap")
    deploy = next(d for d in docs if d.get("kind") == "Deployment")
    [container] = deploy["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert args[0] == "trtllm-serve" and "--extra_llm_api_options" in args
    assert "--disable_overlap_scheduler" not in " ".join(args)
    return yaml.safe_load(config["data"]["extra-llm-api-options.yaml"]), {e["name"]: e["value"] for e in container["env"]}


def _quickstart() -> tuple[dict, dict[str, str]]:
    page = blocks(DOCS / "trtllm-serve.md")
    [options] = [yaml.safe_load(b.text) for b in page if b.lang == "yaml"]
    env = dict(re.findall(r"^export (S3KV_\w+)=(\S+)", "".join(b.text for b in page), re.M))
    serve = next(b.text for b in page if "trtllm-serve " in b.text)
    assert "--extra_llm_api_options examples/extra-llm-api-options.yaml" in serve
    assert options == _example_options()  # the page shows the file it runs
    return options, env


def _example_options() -> dict:
    return yaml.safe_load((REPO / "examples" / "extra-llm-api-options.yaml").read_text())


PAGES = {"kubernetes.md": _kubernetes, "trtllm-serve.md": _quickstart}


def _with_local_secret(env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """The page's mounted integrity-key Secret, as a file holding a key here."""
    if "S3KV_INTEGRITY_KEY_FILE" not in env:
        return env
    secret = tmp_path / "integrity-key"
    secret.write_text("0123456789abcdef" * 4)
    return {**env, "S3KV_INTEGRITY_KEY_FILE": str(secret)}


def _engine(options: dict, env: dict[str, str], url: str, tmp_path: Path, key: str, monkeypatch):
    """A simulated engine built the way TensorRT-LLM builds one from ``options`` and ``env``."""
    from s3kv.sim import SimCacheConfig, SimEngine, gemma3_like
    from s3kv.sim import engine as sim_engine

    assert set(options) <= {"kv_cache_config", "kv_connector_config"} | set(ENGINE_DEFAULTS), options
    kv = options.get("kv_cache_config", {})
    assert set(kv) <= KV_CACHE_FIELDS and set(options["kv_connector_config"]) == CONNECTOR_FIELDS
    # What TensorRT-LLM requires of a connector, and what s3kv needs for full hits.
    assert kv["enable_block_reuse"] is True and kv["use_kv_cache_manager_v2"] is True
    assert kv.get("enable_partial_reuse") is False
    engine_args = {**ENGINE_DEFAULTS, **{k: options[k] for k in ENGINE_DEFAULTS if k in options}}
    real = sim_engine.make_llm_args

    def from_options(*a, **k):
        args = real(*a, **k)
        cache = dataclasses.replace(args.kv_cache_config, **{f: kv[f] for f in kv if f != "max_attention_window"})
        return dataclasses.replace(args, kv_cache_config=cache, **engine_args)

    monkeypatch.setattr(sim_engine, "make_llm_args", from_options)
    cc = options["kv_connector_config"]
    module = importlib.import_module(cc["connector_module"])
    leader_cls = getattr(module, cc["connector_scheduler_class"])
    worker_cls = getattr(module, cc["connector_worker_class"])
    # The page's environment, with its bucket swapped for a directory and its mounted Secret for a
    # file holding a key (same settings otherwise).
    env = _with_local_secret(env, tmp_path)
    settings = load_settings({**env, "S3KV_URL": url, "S3KV_METRICS_PORT": "0", "S3KV_LOOKUP_TIMEOUT_S": "0"})
    assert settings.check_access  # constructing the connectors checks the store, as at start-up
    return SimEngine(gemma3_like(64), SimCacheConfig(tokens_per_block=16, max_seq_len=16384), leader_cls, worker_cls,
                     tp_size=1, connector_kwargs=dict(settings=settings, engine_key=key))


def _hit_lines(engine) -> dict[str, float]:
    from prometheus_client import generate_latest

    rt = engine.leader._runtime
    rt.observe(leader_stats=engine.leader.core.stats)
    text = generate_latest(rt.metrics.registry).decode()
    return {m: float(v) for m, v in re.findall(r"^(s3kv_(?:prompt|hit)_tokens_total) (\S+)$", text, re.M)}


@pytest.mark.parametrize("page", sorted(PAGES))
def test_deployment_passes_bring_up_and_serves_a_shared_prefix_from_s3(page, tmp_path, monkeypatch):
    from s3kv.sim import random_tokens
    from s3kv.sim.request import SimRequestSpec

    options, env = PAGES[page]()
    assert "disable_overlap_scheduler" not in options  # TensorRT-LLM's default loop stays on
    url = f"file://{tmp_path}/cache"
    import random

    rng = random.Random(page)
    # Longer than one checkpoint: a sliding-window model's shared prefix is served up to the last
    # S3KV_CHECKPOINT_TOKENS boundary inside it (the page's "Why 8,192").
    checkpoint = load_settings({**_with_local_secret(env, tmp_path), "S3KV_URL": url}).checkpoint_tokens
    prefix = random_tokens(rng, checkpoint + 300, 32000)
    try:
        first = _engine(options, env, url, tmp_path, f"{page}-1", monkeypatch)
    except UnsupportedEngine as exc:
        if ConnectorSide.requires_disable_overlap_scheduler and "overlap" in str(exc):
            pytest.xfail(f"bring-up still refuses the overlap scheduler (issue 32.1 lifts it): {exc}")
        raise
    with first:
        first.run([SimRequestSpec(1, tuple(prefix + random_tokens(rng, 20, 32000)), 8)])
        for w in first.workers:
            assert w.flush(60)
    second = _engine(options, env, url, tmp_path, f"{page}-2", monkeypatch)
    with second:
        report = second.run([SimRequestSpec(2, tuple(prefix + random_tokens(rng, 20, 32000)), 8)])
        metrics = _hit_lines(second)
    assert report.kv_mismatches == 0
    assert metrics["s3kv_prompt_tokens_total"] == len(prefix) + 20
    assert metrics["s3kv_hit_tokens_total"] == checkpoint == report.matched_tokens


def test_the_test_extra_installs_what_the_tests_import():
    """pyyaml came only through moto[server]; an importorskip hid its absence as a skip."""
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    test_extra = re.search(r"^test = \[(.*?)^\]", text, re.S | re.M)  # (tomllib: Python 3.11+)
    assert test_extra and '"pyyaml' in test_extra.group(1)


def test_the_options_file_the_kubernetes_configmap_and_the_python_line_agree():
    """Issue 40: one ready options file for trtllm-serve, the same in the Kubernetes ConfigMap, and
    its one-line Python equivalent; TensorRT-LLM's own key names (KvCacheConnectorConfig,
    KvCacheConfig fields)."""
    from s3kv.trtllm import llm_api_options

    example = _example_options()
    assert example == llm_api_options() == _kubernetes()[0]
    assert example["kv_connector_config"] == {"connector_module": "s3kv.trtllm",
                                              "connector_scheduler_class": "S3KvConnectorLeader",
                                              "connector_worker_class": "S3KvConnectorWorker"}
    assert set(example["kv_cache_config"]) <= KV_CACHE_FIELDS
    # Further kv_cache_config fields ride along; one that contradicts what s3kv needs is refused.
    extra = llm_api_options(free_gpu_memory_fraction=0.8, max_attention_window=[1024, 32768])
    assert extra["kv_cache_config"] == {**example["kv_cache_config"], "free_gpu_memory_fraction": 0.8,
                                        "max_attention_window": [1024, 32768]}
    with pytest.raises(ValueError, match=r"^kv_cache_config.enable_block_reuse=False: s3kv needs True \("):
        llm_api_options(enable_block_reuse=False)


def test_the_python_line_leaves_v2_off_on_the_flat_api_line(monkeypatch):
    """On the flat-API line (no kv_cache_layout module) connectors run on KV cache manager V1 only."""
    from s3kv.trtllm import api, llm_api_options

    monkeypatch.setattr(api, "HAVE_TRTLLM", True)
    monkeypatch.setattr(api, "HAVE_TRTLLM_LAYOUT", False)
    assert llm_api_options()["kv_cache_config"] == {"enable_block_reuse": True, "enable_partial_reuse": False}
    monkeypatch.setattr(api, "HAVE_TRTLLM_LAYOUT", True)
    assert llm_api_options()["kv_cache_config"]["use_kv_cache_manager_v2"] is True
