"""offload-connector: a host-RAM second tier for an LLM engine's paged KV cache.

Shared types live here (config, hashing, metadata); they import neither `scheduler_side` nor
`worker_side`, nor vLLM. `offload_connector.vllm_connector` is the vLLM adapter (imports vLLM lazily).
"""

from offload_connector.config import ConfigError, OffloadConfig, load_config

__all__ = ["ConfigError", "OffloadConfig", "load_config"]
