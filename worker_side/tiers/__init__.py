"""The I/O of tiers below the CPU tier, between them and the host pool: the interface (`base.py`), the
registry by config section name (`registry.py`), one module per tier (`remote_io.py`: Redis)."""
