"""The teacher: everything that runs or describes the model a drafter learns from, for stage 0's
regeneration, stage 1's build and stage 2's decoding alike. The transformers engine (teacher),
vLLM's (vllm_engine, with its process, state socket and the scripts vLLM's python runs in
vllm_extract/), the teacher's files read by name (teacher_files), which layers are tapped
(tapped_layers), how a chat is rendered (chat_template, under the budget of chat_sandbox) and
nucleus filtering (sampling). Imports only dflash_common; the settings (settings/) load no torch."""
