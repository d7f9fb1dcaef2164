"""The vLLM side of `dflash-cache build --engine vllm`: files run by the python of vLLM's own
environment, which has none of dflash's packages. `extract_worker.py` is the script; it makes
`dflash_hs_connector` (the KV connector vLLM loads by module name) and `dflash_frames` (the wire
format, also read by dflash_teacher.vllm_process and dflash_teacher.state_receiver) importable by
putting this folder on the path. Nothing here imports dflash."""
