"""The CUDA backend and every part of it; all CUDA calls go through `api.CudaRuntime`."""
