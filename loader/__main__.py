"""``python -m loader``: the command-line tools (see ``loader.cli``)."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
