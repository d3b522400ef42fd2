"""Bundled data: the Mooncake synthetic trace (Apache-2.0, see NOTICE)."""
