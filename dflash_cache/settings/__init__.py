"""The settings of the cache itself, torch-free: how a cache stores what it holds (storage_config);
the build's other sections are in dflash_build.settings and dflash_corpus.settings. The
implementation modules import these; these import no torch, zarr or pyarrow, so the command line
reads and checks them without loading those."""
