"""`ConfigError`, the one error of a bad configuration, and where its key was set (`locate`).

A message names the key, the value as the user wrote it, what is allowed, optionally a detail and a guess
("did you mean ...?"), and, once a caller knows the sources of the config, where the key was set: a file's
absolute path, vLLM's `kv_connector_extra_config`, or nowhere (the default). Imports nothing from the
project.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class ConfigError(ValueError):
    """Invalid configuration: the message names the key, the bad value as the user wrote it, what is allowed
    and, once the caller knows it (`located`, `locate`), where the key was set."""

    def __init__(self, key: str, value: Any, allowed: str, detail: str = "", *, where: str = "",
                 guess: str = "") -> None:
        self.key, self.value, self.allowed, self.detail, self.where, self.guess = key, value, allowed, detail, where, guess
        notes = "; ".join(n for n in (detail, f"did you mean {guess}?" if guess else "") if n)
        super().__init__(f"invalid config key '{key}': got {value!r}; allowed: {allowed}"
                         + (f" ({notes})" if notes else "") + (f" ({where})" if where else ""))

    def located(self, where: str) -> ConfigError:
        """The same error saying `where` ("in /abs/offload.yaml", "in kv_connector_extra_config", ...); an
        error that already says where is returned as it is."""
        if self.where:
            return self
        return ConfigError(self.key, self.value, self.allowed, self.detail, where=where, guess=self.guess)


def locate(err: ConfigError, sources: Sequence[tuple[str, Mapping[str, Any]]],
           aliases: Mapping[str, str] | None = None) -> ConfigError:
    """`err` saying where its key was set: the first of `sources` ((name, raw mapping), highest priority
    first) that sets the key or one of its `aliases` (alias -> key), else that the key was left at its
    default; a pseudo-key (`<root>`) is put in the first source."""
    names = [err.key] + [alias for alias, key in (aliases or {}).items() if key == err.key]
    for where, data in sources:
        if any(sets(data, name) for name in names):
            return err.located(f"in {where}")
    if not sources:
        return err
    if err.key.startswith("<"):
        return err.located(f"in {sources[0][0]}")
    return err.located(f"not set in {' or '.join(w for w, _ in sources)}: the default")


def sets(data: Any, dotted_key: str) -> bool:
    """Whether the mapping `data` itself sets the (dotted) key, e.g. `transfer.num_streams`."""
    for name in dotted_key.split("."):
        if not isinstance(data, Mapping) or name not in data:
            return False
        data = data[name]
    return True
