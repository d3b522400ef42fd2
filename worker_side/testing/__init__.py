"""Test doubles, apart from the product: the simulated CUDA device and the fault-injecting backend."""
