"""The settings of the teacher, one torch-free module per part: which teacher runs and how
(teacher_config) and vLLM's engine options (vllm_args); the chat-template kwargs a template may
be given are checked in dflash_common.template_kwargs, which the corpus, the cache's reader and
every stage's settings share. The implementation modules import these;
these import no torch, zarr or pyarrow, so the command lines read and check them without loading those."""
