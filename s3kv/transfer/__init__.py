"""Data movement between the KV cache, host staging and the object store.

* :mod:`.staging` — the bounded host staging pool (pinned on CUDA).
* :mod:`.copies` — page copies device<->host, stream-ordered on CUDA.
* :mod:`.upload` — background uploads of sealed objects.
* :mod:`.download` — verified ranged reads of objects into cache slots.
"""
