"""``loader.cli``: the command line's entry point, kept at the top for ``python -m loader`` users and
scripts that import it; the verbs live in ``loader.tools``."""

from .tools.cli import main

__all__ = ["main"]
