"""GRAPE: target tasks, the probe, the fused alignment Gram (gram/), the reweighting methods (reweighting/,
with the one method registry) and the controller that ties them to a mixer.

controller (when to update; probe -> Gram -> reweight -> mixer; metrics dict), probes (batches, padding,
the one model unwrap), alignment (the probe's Gram), trajectory (JSONL), replay (method "schedule"),
checkpoint (state format, bounded history), methods (what a controller accepts), metrics, collectives,
mixer_port, tasks. docs/design.md maps them; docs/reweighting.md has the math.
"""
