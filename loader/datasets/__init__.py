"""What users iterate: ``AsyncS3Dataset`` (``iterable``) and ``AsyncS3MapDataset`` (``mapped``), with
their options, the sources of keys, the pure partition and shuffle, topology, progress and stats."""
