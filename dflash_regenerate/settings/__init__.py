"""The settings of stage 0 (regenerate), torch-free: what a run may be given and how each value
is checked, so the command line reads them (and prints --help) without loading torch."""
