"""offload-connector: a host-RAM second tier for an LLM engine's paged KV cache.

The package's own modules are the shared layer both sides build on: config (`config.py`), hashing, the
per-step metadata and reports, sizing, a model's KV shape (`model_kv.py`) and the shared remote tier's client
(`remote/`). They import neither `scheduler_side` nor `worker_side`, nor vLLM, nor torch.
The faces, which wire both sides together, are subpackages: `vllm/` (the vLLM adapter; users name it as
`offload_connector.vllm_connector`), `fake_engine/` (a vLLM-like engine with a fake model, for tests and
replays) and `cli/` (the `offload-connector` command: replay, check).
"""

from offload_connector.config import ConfigError, OffloadConfig, load_config

__all__ = ["ConfigError", "OffloadConfig", "load_config"]
