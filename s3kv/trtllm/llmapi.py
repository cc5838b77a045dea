"""What an LLM needs to run s3kv: the connector classes and the ``kv_cache_config`` flags.

Written once, here. ``llm_api_options()`` is the LLM API's one line::

    llm = LLM(model=..., **s3kv.trtllm.llm_api_options())

and ``examples/extra-llm-api-options.yaml`` is the same for ``trtllm-serve
--extra_llm_api_options`` (``tests/test_deployments.py`` holds the two equal). The keys are
TensorRT-LLM's own: ``kv_connector_config`` (``KvCacheConnectorConfig``: module and class names)
and ``kv_cache_config`` (``KvCacheConfig``). Plain dicts, as the options file gives them: the
LLM API validates them into those classes, and this module never imports TensorRT-LLM.
"""

from __future__ import annotations

from typing import Any

#: ``kv_connector_config``: where TensorRT-LLM finds the two sides (each built as ``cls(llm_args)``).
CONNECTOR: dict[str, str] = {
    "connector_module": "s3kv.trtllm",
    "connector_scheduler_class": "S3KvConnectorLeader",
    "connector_worker_class": "S3KvConnectorWorker",
}

#: ``kv_cache_config`` flags s3kv needs, each with why.
KV_CACHE: dict[str, tuple[bool, str]] = {
    "enable_block_reuse": (True, "TensorRT-LLM refuses a connector without it"),
    "use_kv_cache_manager_v2": (True, "one KV pool per attention window: the layout line's connector path, "
                                      "which VSWA models such as Gemma-3 need"),
    "enable_partial_reuse": (False, "a device match that ends inside a block would get no S3 hit"),
}


def _needed() -> dict[str, bool]:
    """The flags for the TensorRT-LLM installed here: on the flat-API line (PyPI 1.2.x, no
    ``kv_cache_layout`` module) connectors run on KV cache manager V1 only, so the V2 flag is left
    out there (found by the feature, never the version); without TensorRT-LLM, the layout line's."""
    from . import api

    flat = api.HAVE_TRTLLM and not api.HAVE_TRTLLM_LAYOUT
    return {k: v for k, (v, _) in KV_CACHE.items() if not (flat and k == "use_kv_cache_manager_v2")}


def llm_api_options(**kv_cache_config: Any) -> dict[str, Any]:
    """``kv_connector_config`` and ``kv_cache_config`` for ``LLM(**...)`` (or an options file).

    Keyword arguments are further ``kv_cache_config`` fields (``free_gpu_memory_fraction=0.8``,
    ``max_attention_window=[...]``); one that contradicts a flag s3kv needs is a ValueError naming
    it and why.
    """
    needed = _needed()
    for name, value in kv_cache_config.items():
        if name in needed and value != needed[name]:
            raise ValueError(f"kv_cache_config.{name}={value!r}: s3kv needs {needed[name]!r} ({KV_CACHE[name][1]})")
    return {"kv_cache_config": {**kv_cache_config, **needed}, "kv_connector_config": dict(CONNECTOR)}
