"""The teacher: everything that runs or describes the model a drafter learns from, for stage 0's
regeneration, stage 1's build and stage 2's decoding alike. The transformers engine (teacher), vLLM's
(vllm_engine, with its worker process in vllm_process, its hidden-state socket in state_receiver and
the scripts vLLM's python runs in vllm_extract/), the teacher's files read by name (teacher_files),
which layers are tapped and served (tapped_layers), which Gated DeltaNet implementation runs
(deltanet_kernels), how a chat is rendered (chat_template, under the budget of chat_sandbox,
render_budget and text_measures) and nucleus filtering (sampling). Imports only dflash_common; the
settings (settings/) load no torch."""
