"""The decoding engine: static caches, shape buckets, CUDA graphs, the target's token choice,
continuous batching and speculative decoding. Imports only the core."""
