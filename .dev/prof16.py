"""Profile the executor thread of a strict-summary 16k lookup (helpers on)."""
import cProfile, os, pstats, random, sys, time
from s3kv.config import Settings
from s3kv.engine.runtime import s3_options
from s3kv.tools.bench.common import bench_store
from s3kv.tools.bench.clients import s3kv_stores, shaped, fan_out
from s3kv.tools.bench.lookup import LookupConfig, geometry, populate, real_sizing, _leader, VOCAB

N = int(os.environ.get("N", "16384")); R = int(os.environ.get("R", "30")); CL = os.environ.get("CL", "obstore_helpers")
TRUST = float(os.environ.get("TRUST", "0"))
cfg = LookupConfig(prompts=(N,))
with bench_store(None, latency_ms=float(os.environ.get("LAT", "20")), name="prof") as bs:
    settings = Settings(max_concurrency=bs.concurrency)
    sizing = real_sizing(cfg.model, cfg.tokens_per_block); geom = geometry(cfg)
    rng = random.Random("s3kv-bench/lookup"); stream = [rng.randrange(VOCAB) for _ in range(N)]
    populate(bs, cfg, settings, geom, stream, sizing)
    procs = s3_options(settings).head_processes
    plain = s3kv_stores(bs, head_concurrency=settings.lookup_head_concurrency, head_processes=procs)
    cstore, clat = shaped(bs, plain[CL], fan_out(CL, bs, plain[CL]))
    ss = settings.replace(lookup_summary_s=3600.0, lookup_timeout_s=0.0, lookup_summary_trust_s=TRUST)
    prof = cProfile.Profile()
    cpu = []; wall = []; proc = []
    for i in range(R):
        ld = _leader(ss, cstore, bs.key("s3kv"), geom, sizing)
        summ = ld.lookup_summary(); assert summ.refresh(); summ.start()
        own = list(stream)
        c0, p0, t0 = time.thread_time(), time.process_time(), time.perf_counter()
        if i >= 3: prof.enable()
        hit, _ = ld.get_num_new_matched_tokens(100 + i, own, len(own), 0, owned=True)
        if i >= 3: prof.disable()
        cpu.append(time.thread_time() - c0); proc.append(time.process_time() - p0); wall.append(time.perf_counter() - t0)
        ld.close_lookup()
    import statistics as st
    print(f"hit {hit} thread {st.median(cpu)*1e3:.2f} ms process {st.median(proc)*1e3:.2f} wall {st.median(wall)*1e3:.1f}", file=sys.stderr)
    ps = pstats.Stats(prof, stream=sys.stderr); ps.sort_stats("tottime").print_stats(25); ps.print_callers("builtins.min|builtins.sorted|span_from_metadata|_decode")
    for st_ in plain.values(): st_.close()
