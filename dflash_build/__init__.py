"""Stage 1's build (`dflash-cache build`): the pipeline from corpus to committed cache (``pipeline``),
its parts (a row's tokens and loss mask, the shard cut, the teacher's pass, the queue to the writer
thread), the output folder and resume, the manifest keeper with finalize, and `verify --deep`
(``deep_verify``, which reruns the teacher). It reads the corpus through dflash_corpus and writes
through dflash_cache. What the command line calls: ``build_cache``, ``estimate``,
``finalize_cache`` (and ``BuildConfig``, the build's settings)."""

from dflash_build.settings.build_config import BuildConfig

__all__ = ["BuildConfig", "build_cache", "estimate", "finalize_cache"]


def __getattr__(name: str):
    # The pipeline loads the teacher (torch, transformers): only when it is asked for, so
    # `dflash-cache finalize` merges a cache's records without them.
    if name in ("build_cache", "estimate"):
        from dflash_build import pipeline

        return getattr(pipeline, name)
    if name == "finalize_cache":
        from dflash_build.commit import finalize_cache

        return finalize_cache
    raise AttributeError(f"module 'dflash_build' has no attribute {name!r}")
