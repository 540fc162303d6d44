"""The vLLM engine: the server's environment (env), its process (server), the client engine (engine) and Miles'
worker extension that runs inside the server (worker/miles_vllm_worker.py, shipped as package data)."""
