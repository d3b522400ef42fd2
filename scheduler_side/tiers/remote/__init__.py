"""The shared remote tier (Redis / Valkey): which requests wait on it and what it fetches."""
