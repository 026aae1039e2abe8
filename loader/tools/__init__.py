"""``python -m loader``: the command line (``cli``) and its verbs: ``serve`` (``devserver``,
``background``), ``ls``, ``shard``, ``index``, ``bench``, ``demo``. Nothing in the data path
imports this package; users' tests reach the dev server through ``loader.testing``.
"""
