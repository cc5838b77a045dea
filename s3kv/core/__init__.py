"""The pure core: what s3kv decides, with no network, no CUDA and no threads.

Every module here is a function of its inputs (a cache geometry, token lists, settings, bytes):
keys (``keys``), geometry (``layout``), the VSWA hit rule (``hitrule``), what is stored
(``policy``), lookup planning (``lookup``), the per-iteration plans leader and workers exchange
(``plan``), the object format (``objects``) and its integrity tags (``integrity``), the S3
request and dollar model (``cost``) and the errors (``errors``). The I/O lives at the edges
(``s3kv.store``, ``s3kv.transfer``); per-request state lives in ``s3kv.engine``.
``tests/test_layering.py`` holds the line.
"""
