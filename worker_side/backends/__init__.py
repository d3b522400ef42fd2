"""Copy backends: the `TransferBackend` interface, the CPU backend and the CUDA backend."""
