"""What a person runs: the ``s3kv`` command line and the tools behind it.

* ``cli`` -- the ``s3kv`` command group (``s3kv.cli:main`` is its console-script entry point);
* ``demo`` -- ``s3kv demo``: two simulated clusters sharing one bucket (``python -m s3kv.tools.demo``
  is the child process each cluster runs in);
* ``ops`` -- ``s3kv ls | stats | verify | gc`` over a bucket;
* ``sizing`` -- ``s3kv size``: bytes, requests and dollars per prompt from the connector's own rules;
* ``faultmatrix`` -- ``python -m s3kv.tools.faultmatrix``: the fault matrix of docs/reliability.md;
* ``logs`` -- log formatting for these processes (library code only logs; it never configures logging);
* ``bench/`` -- ``s3kv bench ...``: measured numbers against the baselines they beat.

Tools sit on top of everything else (engine, adapter, simulator, stores); no other layer imports them.
"""
