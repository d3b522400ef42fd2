"""Tiers below the CPU tier, as the scheduler sees them: the interface (`base.py`), the registry by config
section name (`registry.py`), and one package or module per tier (`remote/`: Redis)."""
