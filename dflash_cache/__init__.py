"""Stage 1 of dflash: build, read and verify teacher caches. ``open_cache(url)`` is the reader."""

from dflash_common.errors import BadRowError, CacheError, ConfigError, DFlashError, TeacherError

__all__ = ["open_cache", "Cache", "SequenceRecord", "DFlashError", "ConfigError", "BadRowError", "CacheError", "TeacherError"]


def __getattr__(name: str):
    # The reader loads zarr and pyarrow: only when it is asked for, so the settings of a build
    # (dflash_cache.settings) import without them.
    if name in ("Cache", "SequenceRecord", "open_cache"):
        from dflash_cache import reader

        return getattr(reader, name)
    raise AttributeError(f"module 'dflash_cache' has no attribute {name!r}")
