"""The settings of the teacher, one torch-free module per part: which teacher runs and how
(teacher_config), vLLM's engine options (vllm_args) and the chat-template kwargs a
template may be given (template_kwargs). The implementation modules import these;
these import no torch, zarr or pyarrow, so the command lines read and check them without loading those."""
