import sys, time, torch
sys.path.insert(0, "tests")
from sim_connectors import OracleLeader, OracleWorker, OracleStore
from s3kv.sim import *
dev = sys.argv[1] if len(sys.argv) > 1 else "cpu"
model = gemma3_like(1024, num_layers=12, kv_heads=8, head_dim=128)
cfg = SimCacheConfig(tokens_per_block=32, max_seq_len=8192, audit=(len(sys.argv) > 2), pages_per_group=560)
store = OracleStore()
eng = SimEngine(model, cfg, OracleLeader, OracleWorker, chunk_size=2048, max_batch=4, device=dev,
                connector_kwargs={"store": store})
lay = eng.layouts[0]
print("page bytes per group:", [g.bytes_per_page for g in lay.groups], "arena MiB", eng.pools[0].arena.numel() / 2**20)
wl = shared_prefix_workload(n_users=4, system_len=2048, user_len=2048, max_new_tokens=16)
for name, specs in [("cold", wl), ("warm", repeat_workload(wl, 100))]:
    t = time.perf_counter()
    r = eng.run(specs)
    print(name, f"{time.perf_counter()-t:.2f}s", r.summary())
    print("   forward s total", round(sum(r.forward_wall_s), 3), "check s", round(r.check_seconds, 3),
          "hooks", {k: round(v, 3) for k, v in r.hook_seconds.items() if v > 0.01})
