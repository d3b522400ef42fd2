"""The CPU block pool: blocks with reference counts, the prefix-cache map and its free queues."""
