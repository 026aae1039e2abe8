"""How bytes become samples: tar parsing (``tar``), grouping members into samples (``grouping``),
compressed shards (``compression``), shard jobs (``shards``), and packing objects into shards
(``packing``, the pure half of ``loader shard``).
"""
