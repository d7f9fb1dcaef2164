"""The settings of a cache build, torch-free: everything `dflash-cache build` is given and how each
value is checked (build_config, composing the corpus's, the storage's and the teacher's sections). The
implementation modules import these; these import no torch, zarr or pyarrow, so the command line
reads and checks them without loading those."""
