"""What runs inside the engine process: the only places that hold per-request state.

* ``leader`` -- the scheduler side (``LeaderCore``): lookups, load plans, save plans, finish plans;
* ``worker`` -- one rank (``WorkerCore``): executes each iteration's plan, loads and saves pages;
* ``runtime`` -- what the leader and the workers of one engine share (store client, index, geometry);
* ``index`` -- the keys known to exist (own uploads, recent HEADs), bounded and expiring;
* ``summary`` -- the namespace summary: one LIST answers cold misses without a request;
* ``metrics`` -- the engine's Prometheus registry, its HTTP endpoint and the store wrapper feeding it.

Engine code builds on ``s3kv.core`` (pure decisions), ``s3kv.store`` and ``s3kv.transfer`` (I/O);
it knows nothing of TensorRT-LLM's types (``s3kv.trtllm`` translates them).
"""
