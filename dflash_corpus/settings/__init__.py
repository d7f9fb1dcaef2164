"""The settings of corpus reading, torch-free: which corpus is read and how each row is taken
(corpus_config). The implementation modules import these; these import no torch, zarr or pyarrow."""
