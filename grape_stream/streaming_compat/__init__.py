"""Workarounds for mosaicml-streaming traps (shared memory, local index cache), kept in one guarded place."""
