"""The vLLM adapter (a face): vLLM's KV-connector hooks mapped onto scheduler_side and worker_side.

Imports vLLM lazily. Users name it as `offload_connector.vllm_connector` (kept as an alias module).
"""
