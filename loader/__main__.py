"""``python -m loader``: the command-line tools (see ``loader.tools.cli``)."""

from .tools.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
