"""What a person runs: the ``s3kv`` command line and the tools behind it.

* ``cli`` -- the ``s3kv`` command group (``s3kv.cli:main`` is its console-script entry point);
* ``demo`` -- ``s3kv demo``: two simulated clusters sharing one bucket, each in a child process
  started with ``python -I`` (so a folder named ``s3kv`` in the working directory is never imported);
* ``ops`` -- ``s3kv ls | stats | verify | gc`` over a bucket;
* ``sizing`` -- ``s3kv size``: bytes, requests and dollars per prompt from the connector's own rules;
* ``faultmatrix`` -- ``s3kv bench faults``: the fault matrix of docs/reliability.md;
* ``options`` -- what the commands share (error wording, ``--url``'s check, Ctrl-C), so none imports another;
* ``configcmd`` -- ``s3kv config``: every effective setting and where it came from;
* ``glossary`` -- ``s3kv glossary``: the words the output uses (docs/glossary.md);
* ``storeerrors`` -- the one wording every command uses for a store error;
* ``logs`` -- log formatting for these processes (library code only logs; it never configures logging);
* ``bench/`` -- ``s3kv bench ...``: measured numbers against the baselines they beat.

Tools sit on top of everything else (engine, adapter, simulator, stores); no other layer imports them.
"""
