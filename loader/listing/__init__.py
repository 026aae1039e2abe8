"""Listing: a prefix listed as key ranges in parallel (``keylist``, ``ranges``, ``keyspace``), the
compact ``KeyList`` it gives, the files that hold one (``keyfile``: snapshots users keep,
``snapshots``; the copy a machine's processes share, ``nodeshare``), one listing per job
(``sharing``), what a key list says each version is (``versions``), and where keys and shard URLs
come from (``inputs``: prefixes, manifests, patterns)."""
