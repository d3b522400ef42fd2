"""Eviction policies of the CPU tier's block pool: the interface (base.py), LRU, ARC and the registry by name."""
