"""The shard index (``index.json`` beside the shards): its format (``format``), writing one for
shards other tools made (``write``, behind ``loader index``), reading it back (``read``), and the
sample counts a shard dataset takes from it (``counts``)."""
