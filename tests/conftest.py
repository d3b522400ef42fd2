import logging
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


def pytest_collection_modifyitems(config, items):
    if os.environ.get("OFFLOAD_SOAK") == "1":
        return
    skip = pytest.mark.skip(reason="long soak: set OFFLOAD_SOAK=1")
    for item in items:
        if "soak" in item.keywords:
            item.add_marker(skip)


OUR_LOGGERS = ("offload_connector", "scheduler_side", "worker_side")
_PRISTINE = {name: (logging.getLogger(name).level, logging.getLogger(name).propagate) for name in OUR_LOGGERS}


@pytest.fixture(autouse=True)
def _our_loggers_as_configured_by_nobody():
    """A vLLM engine built in-process (often in a module-scoped fixture) routes our loggers to vLLM's handler
    (`engine_setup.adopt_vllm_logging`), which `caplog` does not see: every test starts with them as they
    were before any engine ran."""
    for name, (level, propagate) in _PRISTINE.items():
        lg = logging.getLogger(name)
        lg.handlers[:] = []
        lg.setLevel(level)
        lg.propagate = propagate
