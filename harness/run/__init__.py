"""Running sweeps: spec and cells, the parent runner, the per-cell worker process, the memory sampler,
interleaved A/B turns, Ray, progress. The only layer that starts engines."""
