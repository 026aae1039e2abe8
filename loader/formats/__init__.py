"""How bytes become samples: tar parsing (``tar``), compressed shards (``compression``), shard jobs
(``shards``), one object per sample (``objects``), and packing objects into shards with the shard
index's entries (``packing``, ``index_entries``).
"""
