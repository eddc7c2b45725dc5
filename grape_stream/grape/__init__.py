"""GRAPE: target tasks, the fused alignment Gram, the reweighting methods and the controller that ties them to a mixer."""
