/* Batched byte copies for the CPU transfer backend: one call copies a whole shard of segments.
 *
 * Built as an optional extension module (see setup.py); the Python side loads it with ctypes, which
 * releases the GIL for the duration of the call, so a shard costs one foreign call instead of one
 * per segment. Segments never overlap (distinct blocks), so memcpy is safe.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

void oc_copy_segments(const int64_t *dst, const int64_t *src, const int64_t *nbytes, int64_t count) {
    for (int64_t i = 0; i < count; i++) {
        memcpy((void *)(intptr_t)dst[i], (const void *)(intptr_t)src[i], (size_t)nbytes[i]);
    }
}

static struct PyModuleDef segcopy_module = {PyModuleDef_HEAD_INIT, "_segcopy",
                                            "Batched memcpy for worker_side (called through ctypes).",
                                            -1, NULL};

PyMODINIT_FUNC PyInit__segcopy(void) { return PyModule_Create(&segcopy_module); }
