"""The settings of the teacher, one torch-free module per part: which teacher runs and how
(teacher_config) and vLLM's engine options (vllm_args). The implementation modules import these;
these import no torch, zarr or pyarrow, so the command lines read and check them without loading those."""
