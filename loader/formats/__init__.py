"""How bytes become samples: tar parsing (``tar``), shard jobs (``shards``), one object per sample
(``objects``), and packing objects into shards with their index (``packing``, ``index``)."""
