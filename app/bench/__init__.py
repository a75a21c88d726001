"""`phasescope bench`: the pp/tg table against transformers and llama.cpp (tables), the side measurements
(extras: hooks and store, quality, cold start), and the scheduler's (batching, prefix caching)."""
