"""Data: chat records, samples and their cache, length-bucketed batches, prompt sources and
regeneration by the target (on the engine or on serving engines)."""
