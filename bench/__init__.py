"""Throughput benchmarks: this project's loaders side by side with s3torchconnector and webdataset.

``python -m bench.run`` runs the whole matrix (see ``bench/README.md``); ``python -m bench.shards``
is the short shard-mode comparison. Both start the embedded SeaweedFS server, upload a synthetic
JPEG data set, and measure every loader in a child process of its own (``bench.child``), one at a
time, with the same DataLoader settings.
"""
