"""Composer (and llm-foundry) integration: a thin Algorithm over GrapeController, callbacks, the model wrapper."""
