"""The TensorRT-LLM adapter: a thin translation from engine objects to s3kv's cores.

Wire it with ``LLM(model=..., **s3kv.trtllm.llm_api_options())`` (``llmapi``: the connector
classes and the ``kv_cache_config`` flags s3kv needs; ``examples/extra-llm-api-options.yaml`` for
``trtllm-serve``) and ``S3KV_URL=s3://bucket/prefix`` in the environment. Both classes are built
as ``cls(llm_args)``; the optional keyword arguments exist for the simulator and
tests (an explicit store, settings, engine key or engine features), never needed
in production.

Failure policy at this boundary: **no exception ever escapes a connector call**
once the engine is up. TensorRT-LLM's executor dies on one (every request on the
engine fails; under TP the other ranks hang in their next collective). So every
hook catches, logs, counts and degrades to the least harmful answer: a
lookup error is a miss, a save error a dropped save, a load that cannot be
completed with verified bytes takes the failure rung the installed engine
allows (docs/failures.md). Only bring-up -- the constructors and
``register_kv_cache_layout`` -- refuses what s3kv cannot serve correctly, with
one clear message, before the first request.

Inside: ``leader`` (``S3KvConnectorLeader``, the scheduler side), ``worker``
(``S3KvConnectorWorker``, every rank), ``boundary`` (what both sides guard: bring-up
refusals, contained hooks), ``api`` (TensorRT-LLM's connector types, real or stand-in)
and ``identity`` (the model identity read from ``llm_args``).
"""

from __future__ import annotations

from ..core.errors import LoadFailed
from .api import HAVE_TRTLLM
from .boundary import UnsupportedEngine
from .leader import S3KvConnectorLeader
from .llmapi import llm_api_options
from .worker import S3KvConnectorWorker

__all__ = ["S3KvConnectorLeader", "S3KvConnectorWorker", "HAVE_TRTLLM", "LoadFailed", "UnsupportedEngine",
           "llm_api_options"]
