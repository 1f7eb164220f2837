"""Built-in inference engine: paged KV cache, continuous batching, sampling (see notes/ENGINE_API.md)."""
