"""Stage 1 of dflash: build, read and verify teacher caches. ``open_cache(url)`` is the reader."""

from dflash_cache.errors import BadRowError, CacheError, ConfigError, DFlashError, TeacherError
from dflash_cache.reader import Cache, SequenceRecord, open_cache

__all__ = ["open_cache", "Cache", "SequenceRecord", "DFlashError", "ConfigError", "BadRowError", "CacheError", "TeacherError"]
