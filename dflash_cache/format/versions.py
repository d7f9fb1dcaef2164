"""The one place that tells the format versions apart: ``layout_for(version)`` gives the version's
layout (dflash_cache.format.v1, .v2), and everything that depends on the version asks it, so no
other module branches on a version number.

A layout answers: ``version``; ``read_parts`` (the checksummed parts a read of a shard uses),
``plan_parts`` (what a plan over the whole cache reads), ``hidden_checked_as_read`` (whether
hidden-state bytes are checked chunk by chunk as they are read, or hashed whole first) and
``ignored_entries`` (names under a shard folder that are not shards); ``shard_path(root, name)``;
``open_hidden(path)`` (the fast local reader of a shard's hidden states, or None); the manifest's
version part (``check_manifest``, ``manifest_body``); ``listing(store, manifest)``, the shards of
an opened cache (names, records, per-shard sequence counts and sequences, totals, checksums,
capture health, sizes); and for writers ``work_dir``, ``write_hidden`` and ``shard_folders``.
"""

from __future__ import annotations

from typing import Any

from dflash_cache.format import v1, v2
from dflash_cache.format.cache_layout import MANIFEST
from dflash_cache.format.manifest import FORMAT_VERSION, check_manifest, totals
from dflash_cache.format.store import CacheStore, reaching
from dflash_common.errors import CacheError

LAYOUTS = {1: v1.LAYOUT, 2: v2.LAYOUT}


def layout_for(version: int):
    """The layout of format ``version`` (one the manifest check accepted)."""
    return LAYOUTS[version]


def shard_path(root: str, name: str, version: int) -> str:
    """The folder of shard ``name`` in a cache of format ``version`` (its commit record is this path + '.json')."""
    return layout_for(version).shard_path(root, name)


def read_manifest(store: CacheStore) -> dict:
    """manifest.json of the cache in ``store``, checked: its header, then its version's part."""
    where = store.url
    path = store.regular(store.path(MANIFEST))
    with reaching(where):
        exists = store.exists(path)
    if not exists:
        raise CacheError(f"{where}: no manifest.json; not a dflash cache (build one with `dflash-cache build`)")
    with reaching(where):
        manifest = store.read_json_unchecked(path, f"{where}: manifest.json")
    layout_for(check_manifest(manifest, where)).check_manifest(manifest, where)
    return manifest


def write_manifest(store: CacheStore, header: dict, records: list[dict], complete: bool, fault_point: str | None = None,
                   **extra: Any) -> dict:
    """Write manifest.json over these shard records (atomically: index written last) and return it.
    Format 1 lists the records in it; format 2 gives the totals and (``extra``) its ``index``, and
    the dict returned also holds the records under ``shards`` for the caller (the file does not)."""
    layout = layout_for(header.get("format_version", FORMAT_VERSION))
    manifest = dict(header, complete=complete, totals=totals(records), **layout.manifest_body(store, records, extra))
    store.write_json_atomic(store.path(MANIFEST), manifest, fault_point=fault_point)
    return {**manifest, "shards": records}
