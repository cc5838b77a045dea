"""``s3kv bench``: measured numbers for s3kv's claims, side by side with the baselines they beat.

* ``lookup``   -- HEAD round trips and latency of finding a 1k..128k-token prefix (VSWA geometry),
  cold and warm, against the seed's sequential one-HEAD-per-block-per-group scan;
* ``transfer`` -- save / load throughput through the worker pipelines against raw parallel boto3
  and a seed-style one-object-per-page sequential path;
* ``staging``  -- device<->pinned-host page copies against one contiguous memcpy (CUDA only);
* ``e2e``      -- the simulator's multi-turn VSWA workload, cold then warm cluster on one store,
  both storage policies, a prefill-compute estimate for a real model, and a memory soak.

Every command prints a table (or ONE JSON object with ``--json``) and can draw a PNG (``--plot``).
By default each run starts its own loopback S3 server (SeaweedFS, else moto); ``--url`` points at
a real bucket (a run-unique prefix is used and deleted afterwards) or ``memory://name``.
"""
