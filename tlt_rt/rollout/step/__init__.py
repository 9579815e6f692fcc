"""One decode step's pieces, plain or speculative (imported by their modules; nothing is re-exported here).

`graph` is the whole step as one captured program and `io` its host side (packing inputs, parsing the one
host copy); `target` runs the target model (layouts, metadata, acceptance draws) and `drafting` the
drafter's part, whose hidden windows `draft_windows` keeps between steps; `ops` holds the small shared
helpers (KV scratch, compiled glue, draft kernels); `rng` the counter-based uniforms; `prefill` the prefill
and fork; `prepare` readies an engine (capture, warm-up, cost profiling) before it is timed.
"""
