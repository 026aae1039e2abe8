"""What users iterate: ``AsyncS3Dataset`` (``iterable``) and ``AsyncS3MapDataset`` (``mapped``), with
their options, the sources behind the ``Source`` protocol (``protocol``: ``object_source`` with its
``object_samples``, ``shard_source``, ``mix`` with its draw order ``mix_order``), the pure partition
and shuffle, progress and stats."""
