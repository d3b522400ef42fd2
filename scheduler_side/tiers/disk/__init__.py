"""The disk tier's scheduler side: the index of what is on disk, the start-up scan, deletions."""
