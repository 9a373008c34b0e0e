"""From a name to a loaded engine: hub and cache, GGUF conversion, checkpoints, memory checks, placement."""
