"""The disk tier's I/O on a worker rank: record files read into and written out of the host pool."""
