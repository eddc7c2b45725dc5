"""Tools to test a data pipeline against what real storage does (used by our tests and bench/faults.py).

`FaultProxy` sits in front of any S3-compatible endpoint and injects errors, resets, latency and
outages on demand, so a user can check their own job rides out a storage blip before a real one hits.
"""

from grape_stream.testing.fault_proxy import FaultProxy, FaultStats

__all__ = ["FaultProxy", "FaultStats"]
