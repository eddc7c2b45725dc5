"""YAML training recipes shipped with grape_stream (found with importlib.resources)."""
