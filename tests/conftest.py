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
