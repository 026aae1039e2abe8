"""How servers order a listing: the one place that knows they differ, consulted by the range
lister (``listing.ranges``), its key space (``listing.keyspace``) and obstore's lister.

S3 (and MinIO, Ceph, GCS) list in byte order, and ``StartAfter=S`` gives every key after ``S``.
SeaweedFS lists directory by directory (``/`` sorts below every character: ``a/b`` before
``a-c``), and ``StartAfter=S`` skips the keys under ``S/``. ``ListingOrder`` is that capability
of the server, and its rules hold for both orders, so a listing is exact on a server whose order
is not known. It is not a setting: a server said to list in byte order that lists by directory
could lose the keys under a bound without any page showing it (``a/b`` after ``a`` is in byte
order too). Where a server shows its directory order, the range that saw it is not split again
(``wrapped``). Why each rule is exact: docs/design/listing.md.
"""

from __future__ import annotations


class ListingOrder:
    """The order of a server's listings, as far as a client can rely on it (module doc)."""

    __slots__ = ()

    def past(self, key: str, bound: str) -> bool:
        """Whether ``key`` shows that a range ending at ``bound`` is finished: every key the
        server lists after ``key`` is one that ``StartAfter=bound`` returns too. That is a key
        after ``bound`` in byte order and directory by directory, and not under ``bound + "/"``
        (which ``StartAfter=bound`` skips on a server listing by directories)."""
        return key > bound and key.split("/") > bound.split("/") and not key.startswith(bound + "/")

    def avoids_folder_names(self) -> bool:
        """Whether a split point should not be cut where the keys seen have a ``/``: it would
        likely name a folder, which a server listing by directories skips after that bound."""
        return True

    def wrapped(self, start_after: str | None, first_key: str) -> bool:
        """Whether a range's first key came back at or before its ``StartAfter``: the server
        lists by directories, and the range wrapped back over keys another range holds (bounds
        are guessed in byte order), so it must not be split again; it still lists exactly."""
        return start_after is not None and first_key <= start_after

    def forward(self, previous: str, key: str) -> bool:
        """Whether ``key`` may follow ``previous`` in one listing: after it in byte order or
        directory by directory. A key that follows in neither (the same key, an earlier one) is
        a page answered again: the listing would loop."""
        return key > previous or key.split("/") > previous.split("/")

    def beyond_stem(self, key: str, skip: int, stem: str) -> bool:
        """Whether a key listed from a directory (``skip`` characters of it) shows that no later
        key starts with ``directory/stem``: compared by its first path segment below the
        directory, which holds in either order (SeaweedFS puts ``many/0`` before ``many-x/1``,
        which a whole-key comparison would misread)."""
        return key[skip:].partition("/")[0] > stem

    def settled(self, last: str, prefix: str) -> str:
        """The key at or below which (byte order) every key of ``prefix`` has been listed once
        a listing reached ``last``: ``last`` itself, or where ``last`` has a folder below the
        prefix, that folder's name up to its ``/`` (a server listing by directory may still list
        ``a-b`` after ``a/x``; never a key at or below ``a``)."""
        slash = last.find("/", len(prefix))
        return last if slash < 0 else last[:slash]


SERVERS = ListingOrder()  # what every lister consults: the rules that hold on every server
