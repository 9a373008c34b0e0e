"""The transformer (pure compute), its KV cache, and the byte sizes of models and buffers."""
