"""Store policies (what to store each step) and the read-only view of the scheduler they are given."""
