"""The I/O of tiers below the CPU tier, between them and the host pool."""
