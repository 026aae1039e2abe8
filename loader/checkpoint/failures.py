"""Which error a failed ``save`` or ``load`` reports (torch hides ours behind its own), and how it
comes to name the checkpoint's URI.
"""

from __future__ import annotations

import contextlib

from ..errors import StoreError


def _cause(
    exc: BaseException, ours: BaseException | None, outer: BaseException | None
) -> BaseException:
    """What really went wrong when ``torch.save``/``torch.load`` raised ``exc``.

    torch reports a failed ``write`` as a RuntimeError of its own ("unexpected pos"), raised
    while closing the archive, with the real error as its ``__context__``. Our file objects
    record their own failures (``ours``); an interrupt that landed where they could not record
    it (on entry to ``write``, or in torch's Python code) is found in the context chain, down to
    ``outer``, the exception the caller was already handling, if any; any other error that
    escaped a ``write`` is the context of torch's echo.
    """
    if ours is not None:
        return ours
    seen: BaseException | None = exc
    while seen is not None and seen is not outer:
        if not isinstance(seen, Exception):  # KeyboardInterrupt, SystemExit
            return seen
        seen = seen.__context__
    context = exc.__context__
    if _is_torch_echo(exc) and context is not None and context is not outer:
        return context
    return exc


def _is_torch_echo(exc: BaseException) -> bool:
    """torch's complaint, on closing an archive, that an earlier write had failed."""
    return isinstance(exc, RuntimeError) and "unexpected pos" in str(exc)


@contextlib.contextmanager
def _naming(uri: str, action: str):
    try:
        yield
    except BaseException as exc:  # noqa: BLE001 - reraised as the named cause
        raise _named(exc, uri, action)  # noqa: B904 (_named sets the cause)


def _named(
    exc: BaseException, uri: str, action: str, *, hide: BaseException | None = None
) -> BaseException:
    """``exc``, made to name ``uri``: a store error gets it in its message, others a note.

    ``hide``: the exception being handled when ``exc`` is raised, if it is only torch's echo of
    ``exc`` (torch reports a failed write as a RuntimeError of its own), left out of the traceback.
    """
    if hide is not None and hide is not exc:
        exc.__suppress_context__ = True
    if uri in str(exc) or any(uri in note for note in getattr(exc, "__notes__", ())):
        return exc
    if isinstance(exc, StoreError):
        renamed = type(exc)(f"{action} {uri}: {exc}", bucket=exc.bucket, key=exc.key)
        renamed.__cause__ = exc
        renamed.__suppress_context__ = True
        for note in getattr(exc, "__notes__", ()):
            renamed.add_note(note)
        return renamed
    exc.add_note(f"while {action} {uri}")
    return exc
