"""Corpus -> per-domain MDS shards: readers, tokenization, packing, parallel resumable units, upload."""
