"""The shared tier's client, shared by both sides: its config section, record format, breaker and Redis client."""
