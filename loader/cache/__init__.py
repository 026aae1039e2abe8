"""The disk cache: ``CachedStore`` (``store``), a store that answers reads from the cache's files
(``files``) and fills them, under the settings users give (``options``)."""
