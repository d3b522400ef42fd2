"""The disk tier's shared parts: its config section, record format, directory rules and counters."""
