"""What measures a trained drafter: offline replay on a cache, speculative decoding with the teacher, vLLM
serving (vllm_worker.py runs under vLLM's own python), and the eval and generate commands' work."""
