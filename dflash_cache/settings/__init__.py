"""The settings of a cache build, one torch-free module per part: what a build may be given and
how each value is checked. The implementation modules import these; these import no torch, zarr
or pyarrow, so the command line reads and checks them without loading those."""
