"""The Gram matrix of per-group gradients from one fused forward/backward pass."""
