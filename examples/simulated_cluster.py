"""Two simulated clusters sharing a bucket, in one script (the library behind ``s3kv demo``).

    python examples/simulated_cluster.py            # embedded loopback S3
    S3KV_URL=s3://bucket/prefix python examples/simulated_cluster.py

Every page the warm cluster loads is checked byte for byte against what
recomputation would have written.
"""

from __future__ import annotations

import os

from s3kv.store.embedded import EmbeddedS3
from s3kv.tools.demo import DemoShape, run_cluster

#: No time limit on a lookup: in an engine a lookup that runs past its budget is a miss (the
#: scheduler must not stall), but here it would make the figures depend on how busy this machine
#: is. With it, every run prints the same tokens.
SETTINGS = {"lookup_timeout_s": 0.0}


def main() -> None:
    shape = DemoShape(tp_size=2)
    if os.environ.get("S3KV_URL"):
        results = [run_cluster(role, shape, SETTINGS) for role in ("A", "B")]
    else:
        with EmbeddedS3(kind="moto", bucket="s3kv-example", prefix="example") as s3:
            os.environ.update(s3.env())
            results = [run_cluster(role, shape, SETTINGS) for role in ("A", "B")]
    for r in results:
        print(f"cluster {r['role']}: {r['matched_tokens']}/{r['prompt_tokens']} prompt tokens from S3, "
              f"kv_mismatches={r['kv_mismatches']}, {r['s3_requests']} S3 requests")


if __name__ == "__main__":
    main()
