// The gather/scatter kernels of the CUDA transfer backend: many small copies in one launch.
//
// oc_block_copy (the direct path): every copy moves bytes between device memory and registered host memory
// (cuMemHostRegister with the DEVICEMAP flag, read and written through unified virtual addressing); no two
// copies of one launch overlap. The tables that describe the copies also live in registered host memory and
// are read when the kernel runs, not at launch. One thread block per (plane, block) chunk (grid-stride when
// the grid is smaller than the work); its threads move 16 bytes at a time when destination, source and size
// are all 16-byte aligned, else 4 bytes when all are 4-byte aligned, else single bytes. No shared memory.
//
// oc_staged_copy (the staged path, staging.py): device memory to device memory only, between the KV cache and
// a staging slot; the host side is the copy engines' job. Its plane table is in device memory; its block ids
// are in registered host memory, read once per thread block into shared memory (one PCIe round trip per
// thread block, not per chunk). One warp per (block, plane) chunk, chunks no larger than the host side made
// them (copy_plan's plane_table(max_piece)), each lane keeping OC_UNROLL 16-byte loads in flight, so a few
// thread blocks move hundreds of GB/s while the forward keeps the other SMs.
//
// Self-contained on purpose: it is compiled at run time by NVRTC (cupy.RawKernel), so it includes no
// header and uses only built-in types (long long, unsigned int, uint4).
//
// oc_block_copy(planes, num_planes, ids, num_blocks): `planes` holds `num_planes` int64 rows
//   (src_base, dst_base, src_stride, dst_stride, chunk_bytes); `ids` holds `num_blocks` source block ids
//   followed by `num_blocks` destination block ids. For every plane p and block pair i it copies
//   chunk_bytes from src_base + src_ids[i] * src_stride to dst_base + dst_ids[i] * dst_stride.

#define OC_UNROLL 8

// Words k = first, first + step, ... below n: each thread keeps OC_UNROLL loads in flight before it stores.
template <typename T>
__device__ __forceinline__ void oc_copy_words(T* __restrict__ d, const T* __restrict__ s, long long n,
                                              long long first, long long step) {
    long long k = first;
    for (; k + (OC_UNROLL - 1) * step < n; k += OC_UNROLL * step) {
        T r[OC_UNROLL];
#pragma unroll
        for (int u = 0; u < OC_UNROLL; ++u) r[u] = s[k + u * step];
#pragma unroll
        for (int u = 0; u < OC_UNROLL; ++u) d[k + u * step] = r[u];
    }
    for (; k < n; k += step) d[k] = s[k];
}

// nbytes from src to dst by the threads first, first + step, ...: 16 bytes at a time when dst, src and
// nbytes are all 16-byte aligned, else 4 bytes when all are 4-byte aligned, else single bytes.
__device__ __forceinline__ void oc_copy_range(char* __restrict__ dst, const char* __restrict__ src,
                                              long long nbytes, long long first, long long step) {
    const unsigned long long bits =
        (unsigned long long)dst | (unsigned long long)src | (unsigned long long)nbytes;
    if ((bits & 15ULL) == 0) {
        oc_copy_words((uint4*)dst, (const uint4*)src, nbytes >> 4, first, step);
    } else if ((bits & 3ULL) == 0) {
        oc_copy_words((unsigned int*)dst, (const unsigned int*)src, nbytes >> 2, first, step);
    } else {
        for (long long k = first; k < nbytes; k += step) dst[k] = src[k];
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
        oc_copy_range((char*)dst, (const char*)src, plane[4], threadIdx.x, blockDim.x);
    }
}

// oc_staged_copy(planes, num_planes, src_ids, dst_ids, num_blocks): `planes` (device memory) holds
//   `num_planes` int64 rows (src_base, dst_base, src_stride, dst_stride, chunk_bytes); `src_ids` and `dst_ids`
//   (registered host memory) hold `num_blocks` block ids each. For every block pair i and plane p it copies
//   chunk_bytes from src_base + src_ids[i] * src_stride to dst_base + dst_ids[i] * dst_stride.
//   Dynamic shared memory: 16 * num_blocks bytes.
extern "C" __global__ void oc_staged_copy(const long long* __restrict__ planes, long long num_planes,
                                          const long long* src_ids, const long long* dst_ids,
                                          long long num_blocks) {
    extern __shared__ long long oc_ids[];  // src ids, then dst ids
    for (long long k = threadIdx.x; k < num_blocks; k += blockDim.x) {
        oc_ids[k] = src_ids[k];
        oc_ids[num_blocks + k] = dst_ids[k];
    }
    __syncthreads();
    const int lane = threadIdx.x & 31;
    const long long warps_per_block = blockDim.x >> 5;
    const long long num_warps = (long long)gridDim.x * warps_per_block;
    const long long total = num_planes * num_blocks;
    for (long long work = (long long)blockIdx.x * warps_per_block + (threadIdx.x >> 5); work < total;
         work += num_warps) {
        const long long i = work / num_planes;
        const long long* plane = planes + 5 * (work - i * num_planes);
        const long long src = plane[0] + oc_ids[i] * plane[2];
        const long long dst = plane[1] + oc_ids[num_blocks + i] * plane[3];
        oc_copy_range((char*)dst, (const char*)src, plane[4], lane, 32);
    }
}
