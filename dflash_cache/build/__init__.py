"""Stage 1's build: the pipeline from corpus to committed cache (``pipeline``), its parts (the shard
cut, the teacher's pass, the queue to the writer thread), the output folder and resume, and the
manifest keeper with finalize. What the command line calls: ``build_cache``, ``estimate``,
``finalize_cache`` (and ``BuildConfig``, the build's settings)."""

from dflash_cache.settings.build_config import BuildConfig

__all__ = ["BuildConfig", "build_cache", "estimate", "finalize_cache"]


def __getattr__(name: str):
    # The pipeline loads the teacher (torch, transformers): only when it is asked for, so
    # `dflash-cache finalize` merges a cache's records without them.
    if name in ("build_cache", "estimate"):
        from dflash_cache.build import pipeline

        return getattr(pipeline, name)
    if name == "finalize_cache":
        from dflash_cache.build.commit import finalize_cache

        return finalize_cache
    raise AttributeError(f"module 'dflash_cache.build' has no attribute {name!r}")
