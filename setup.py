"""Build the optional C helper of the CPU transfer backend; all metadata lives in pyproject.toml.

`optional=True`: without a C compiler the install still succeeds and the backend falls back to one
`ctypes.memmove` per segment (slower on many small scattered blocks, same bytes).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("worker_side.backends._segcopy", ["worker_side/backends/_segcopy.c"], optional=True,
                             extra_compile_args=["-O2"])])
