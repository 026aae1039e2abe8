"""Unit-test helpers live in ``fakes.py`` (importable by name); the fixtures shared with
``integration/`` (``no_leaked_threads``, ``sigint_raises``) are in the repository's ``conftest.py``."""
