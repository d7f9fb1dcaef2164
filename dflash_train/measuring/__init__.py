"""What measures a trained drafter: offline replay on a cache, speculative decoding with the teacher, vLLM
serving (vllm_worker.py runs under vLLM's own python), the prompt files and per-category report of
real decoding, the statistics (t-intervals) eval and the sweep share, and the eval and generate
commands' work."""
