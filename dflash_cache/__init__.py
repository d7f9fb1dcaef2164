"""Stage 1 of dflash: build, read and verify teacher caches. ``open_cache(url)`` is the reader."""

from dflash_cache.reader import Cache, SequenceRecord, open_cache
from dflash_common.errors import BadRowError, CacheError, ConfigError, DFlashError, TeacherError

__all__ = ["open_cache", "Cache", "SequenceRecord", "DFlashError", "ConfigError", "BadRowError", "CacheError", "TeacherError"]
