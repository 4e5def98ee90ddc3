"""The serving engine: paged KV cache, scheduler, per-sequence sampler, stop strings, and
Engine.step() that ties them together (schedule -> forward -> sample -> append)."""
