"""A small engine that mirrors vLLM v1's loop, used by the tests and `offload-connector replay`.

It wires `scheduler_side` and `worker_side` together (an adapter: it may import both). See
docs/fake_engine.md. Public API: `FakeEngine`, `EngineRequest`, `RequestStatus`, `IntegrityError`,
`EngineStats`, `StoreReadOverlapError`.
"""

from offload_connector.fake_engine.engine import EngineStallError, FakeEngine, StoreReadOverlapError
from offload_connector.fake_engine.model import FakeModel, IntegrityError
from offload_connector.fake_engine.request import EngineRequest, RequestStatus
from offload_connector.fake_engine.stats import EngineStats

__all__ = ["EngineRequest", "EngineStallError", "EngineStats", "FakeEngine", "FakeModel", "IntegrityError",
           "RequestStatus", "StoreReadOverlapError"]
