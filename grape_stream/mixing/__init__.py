"""WeightedStreamingMixer and its parts: quotas, epoch order, live weight table, shard reading, loader."""
