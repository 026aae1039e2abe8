"""``python -m loader``: the command line (``cli``) and its verbs — ``serve`` (``devserver``), ``ls``,
``shard``, ``bench``, ``demo``. Nothing in the data path imports this package."""
