// A stand-in for libcuda.so.1 (tests/test_cuda_bindings_stub.py): the driver entry points the CUDA runtime
// seam calls, each returning $STUB_CODE (0 by default), so the real cuda-bindings can be driven on a machine
// without a GPU, down to the error codes their CUresult enum does not know. $STUB_VERSION is the driver
// version reported (cuMemcpyBatchAsync's ABI follows it). Nothing here touches memory it is pointed at.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
static int code(void) { const char *s = getenv("STUB_CODE"); return s ? atoi(s) : 0; }
static int version(void) { const char *s = getenv("STUB_VERSION"); return s ? atoi(s) : 13000; }

CUresult cuInit(unsigned int flags) { return 0; }
CUresult cuDriverGetVersion(int *v) { *v = version(); return 0; }
CUresult cuGetErrorName(CUresult e, const char **p) {
    if (e == 0) { *p = "CUDA_SUCCESS"; return 0; }
    if (e == 1) { *p = "CUDA_ERROR_INVALID_VALUE"; return 0; }
    *p = NULL;
    return 1;
}
CUresult cuCtxGetCurrent(void **ctx) { *ctx = NULL; return 0; }
CUresult cuCtxSetCurrent(void *ctx) { return 0; }
CUresult cuDevicePrimaryCtxRetain(void **ctx, int dev) { *ctx = (void *)0xC0; return 0; }
CUresult cuDevicePrimaryCtxRelease_v2(int dev) { return 0; }
CUresult cuDeviceGetAttribute(int *v, int attr, int dev) { *v = attr == 16 ? 132 : 1; return code(); }
CUresult cuPointerGetAttribute(void *data, int attr, unsigned long long ptr) {
    if (code()) return code();
    *(int *)data = attr == 2 ? 2 : 0;  // MEMORY_TYPE: device; DEVICE_ORDINAL: 0
    return 0;
}
CUresult cuMemHostRegister_v2(void *p, size_t n, unsigned int flags) { return code(); }
CUresult cuMemHostUnregister(void *p) { return code(); }
CUresult cuMemcpyAsync(unsigned long long dst, unsigned long long src, size_t n, void *stream) { return code(); }
CUresult cuMemcpyBatchAsync(void *d, void *s, void *n, size_t count, void *a, void *i, size_t na, size_t *fail,
                            void *stream) { return code(); }
CUresult cuMemcpyBatchAsync_v2(void *d, void *s, void *n, size_t count, void *a, void *i, size_t na, void *stream) {
    return code();
}

static int versioned(const char *sym, int ver) {  // entry points whose current ABI is their _v2
    return !strcmp(sym, "cuMemHostRegister") || !strcmp(sym, "cuDevicePrimaryCtxRelease")
        || (ver >= 13000 && !strcmp(sym, "cuMemcpyBatchAsync"));
}

CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int ver, unsigned long long flags, int *status) {
    void *self = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    char name[256];
    snprintf(name, sizeof name, "%s%s", sym, versioned(sym, ver) ? "_v2" : "");
    *pfn = self ? dlsym(self, name) : NULL;
    if (status) *status = *pfn ? 0 : 1;
    return *pfn ? 0 : 500;  // CUDA_ERROR_NOT_FOUND
}
CUresult cuGetProcAddress(const char *sym, void **pfn, int ver, unsigned long long flags, int *status) {
    return cuGetProcAddress_v2(sym, pfn, ver, flags, status);
}
