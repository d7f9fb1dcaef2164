"""The settings of training and decoding, one torch-free module per section: what a run may be
given and how each value is checked. The implementation modules import these; these import no
torch, zarr or pyarrow, so a command line can read and check its settings (and print --help)
without loading them. ``train`` composes the sections into a TrainConfig; ``dflash_train.config``
builds one from files and overrides."""
