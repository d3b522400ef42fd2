"""The module path users give vLLM: `kv_connector_module_path="offload_connector.vllm_connector"`.

An alias of `offload_connector.vllm.connector`, where the adapter lives; it holds nothing else.
"""

from offload_connector.vllm.connector import OffloadConnector

__all__ = ["OffloadConnector"]
