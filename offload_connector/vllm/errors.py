"""The vLLM adapter's own error: a vLLM set-up this connector cannot serve.

Raised before anything is allocated (by the version check, the plugin's early checks and the connector's
constructor) with a message naming what is wrong and what is allowed.
"""


class UnsupportedSetupError(ValueError):
    """The vLLM set-up cannot be served by this connector: names what is wrong and what is allowed."""
