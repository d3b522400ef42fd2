// The gather/scatter kernel of the CUDA transfer backend: many small copies in one launch.
//
// Every copy moves bytes between device memory and registered host memory (cuMemHostRegister with the
// DEVICEMAP flag, read and written through unified virtual addressing); no two copies of one launch overlap.
// The tables that describe the copies also live in registered host memory and are read when the kernel
// runs, not at launch. One thread block per (plane, block) chunk (grid-stride when the grid is smaller than the work);
// its threads move 16 bytes at a time when destination, source and size are all 16-byte aligned, else
// 4 bytes when all are 4-byte aligned, else single bytes. No shared memory.
//
// Self-contained on purpose: it is compiled at run time by NVRTC (cupy.RawKernel), so it includes no
// header and uses only built-in types (long long, unsigned int, uint4).
//
// oc_block_copy(planes, num_planes, ids, num_blocks): `planes` holds `num_planes` int64 rows
//   (src_base, dst_base, src_stride, dst_stride, chunk_bytes); `ids` holds `num_blocks` source block ids
//   followed by `num_blocks` destination block ids. For every plane p and block pair i it copies
//   chunk_bytes from src_base + src_ids[i] * src_stride to dst_base + dst_ids[i] * dst_stride.

__device__ __forceinline__ void oc_copy_range(char* __restrict__ dst, const char* __restrict__ src,
                                              long long nbytes) {
    const unsigned long long bits =
        (unsigned long long)dst | (unsigned long long)src | (unsigned long long)nbytes;
    if ((bits & 15ULL) == 0) {
        uint4* __restrict__ d = (uint4*)dst;
        const uint4* __restrict__ s = (const uint4*)src;
        const long long n = nbytes >> 4;
#pragma unroll 4
        for (long long k = threadIdx.x; k < n; k += blockDim.x) d[k] = s[k];
    } else if ((bits & 3ULL) == 0) {
        unsigned int* __restrict__ d = (unsigned int*)dst;
        const unsigned int* __restrict__ s = (const unsigned int*)src;
        const long long n = nbytes >> 2;
#pragma unroll 4
        for (long long k = threadIdx.x; k < n; k += blockDim.x) d[k] = s[k];
    } else {
        for (long long k = threadIdx.x; k < nbytes; k += blockDim.x) dst[k] = src[k];
    }
}

extern "C" __global__ void oc_block_copy(const long long* planes, long long num_planes,
                                         const long long* ids, long long num_blocks) {
    const long long total = num_planes * num_blocks;
    for (long long work = blockIdx.x; work < total; work += gridDim.x) {
        const long long* plane = planes + 5 * (work / num_blocks);
        const long long i = work % num_blocks;
        const long long src = plane[0] + ids[i] * plane[2];
        const long long dst = plane[1] + ids[num_blocks + i] * plane[3];
        oc_copy_range((char*)dst, (const char*)src, plane[4]);
    }
}
