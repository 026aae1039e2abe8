"""The version and the distribution's name, each in one place.

setuptools reads ``__version__`` from here (``pyproject.toml``: dynamic version), and so do
``loader.__version__`` and ``loader --version``. The package imports as ``loader``; it is
installed as ``DISTRIBUTION`` (PyPI's ``loader`` is an unrelated project), the name every install
hint uses.
"""

__version__ = "0.1.0"
DISTRIBUTION = "s3stream-loader"


def install_hint(extra: str | None = None) -> str:
    """``pip install 's3stream-loader[extra]'``: the command that installs an optional extra."""
    return f"pip install '{DISTRIBUTION}[{extra}]'" if extra else f"pip install {DISTRIBUTION}"
