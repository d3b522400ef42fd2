"""Tiers below the CPU tier, as the scheduler sees them."""
