"""The mixer tests' MDS datasets: grape_stream.testing.mds (bench/faults.py writes the same ones)."""

from grape_stream.testing.mds import SEQ_LEN, batch_identities, identity, write_domain, write_domains

__all__ = ["SEQ_LEN", "batch_identities", "identity", "write_domain", "write_domains"]
