"""Dataset-specific readers (SlimPajama, ClimbLab, wiki40b, target tasks, generic); writing lives in grape_stream.convert."""
