"""Built-in inference engine: paged KV cache, continuous batching, sampling (see docs/engine.md)."""
