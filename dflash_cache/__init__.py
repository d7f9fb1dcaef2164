"""The teacher cache: its format, store, writer, reader, shards, read-ahead, health and verify, with no
teacher of its own (stage 1's pipeline that fills it is dflash_build). This module is the cache's public face
for stage 2: ``open_cache(url)`` (the reader), what it hands out, and the few format definitions a
trainer or an evaluation shares with the cache; nothing under it is stage 2's to import."""

from dflash_common.errors import BadRowError, CacheError, ConfigError, DFlashError, TeacherError

__all__ = ["open_cache", "Cache", "Shard", "SequenceRecord", "SIZES", "from_storage",
           "DFlashError", "ConfigError", "BadRowError", "CacheError", "TeacherError"]

# name -> the module that owns it. Loaded when asked for: the reader loads zarr and pyarrow, and the
# cache's settings (dflash_cache.settings) import without them.
_OWNERS = {
    "open_cache": "dflash_cache.reader", "Cache": "dflash_cache.reader",
    "Shard": "dflash_cache.shard", "SequenceRecord": "dflash_cache.shard",
    "SIZES": "dflash_cache.format.integrity", "from_storage": "dflash_cache.format.hidden",
}


def __getattr__(name: str):
    if name in _OWNERS:
        import importlib

        return getattr(importlib.import_module(_OWNERS[name]), name)
    raise AttributeError(f"module 'dflash_cache' has no attribute {name!r}")
