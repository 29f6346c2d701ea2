// kvpool's paged KV gather/scatter kernels, compiled at run time with NVRTC.
//
// One CUDA block moves one token row (kv_heads * head_size elements) of one plane (K, V or the
// MLA latent) of one layer. Grid: x = token, y = layer_rel * planes + plane. A row is copied in
// units of T: uint4 (16 bytes) when the row length and every base address allow it, else
// unsigned int (4 bytes), else bytes.
//
// Paged address (rows of row_bytes inside one layer's tensor):
//   (slot / block_size) * block_stride_rows + plane * plane_stride_rows + slot % block_size
// Chunk address (kvpool's layer-major chunk, see kvpool_core::KvLayout):
//   (layer_rel * planes + plane) * chunk_tokens + token_offset + token

typedef unsigned long long u64;
typedef long long i64;

#define KVPOOL_COPY_KERNELS(SUFFIX, T)                                                          \
extern "C" __global__ void kvpool_gather_##SUFFIX(                                              \
    const u64* __restrict__ layer_ptrs, int first_layer, const i64* __restrict__ slots,         \
    unsigned char* __restrict__ chunk, i64 chunk_tokens, i64 token_offset, int planes,          \
    i64 row_bytes, i64 block_size, i64 block_stride_rows, i64 plane_stride_rows)                \
{                                                                                               \
    const i64 token = blockIdx.x;                                                               \
    const int lp = blockIdx.y;                                                                  \
    const int layer_rel = lp / planes;                                                          \
    const int plane = lp - layer_rel * planes;                                                  \
    const i64 slot = slots[token];                                                              \
    const i64 paged_row = (slot / block_size) * block_stride_rows                               \
        + plane * plane_stride_rows + slot % block_size;                                        \
    const T* src = (const T*)((const unsigned char*)layer_ptrs[first_layer + layer_rel]         \
        + paged_row * row_bytes);                                                               \
    T* dst = (T*)(chunk + ((i64)lp * chunk_tokens + token_offset + token) * row_bytes);         \
    const i64 n = row_bytes / (i64)sizeof(T);                                                   \
    for (i64 i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];                          \
}                                                                                               \
extern "C" __global__ void kvpool_scatter_##SUFFIX(                                             \
    const u64* __restrict__ layer_ptrs, int first_layer, const i64* __restrict__ slots,         \
    const unsigned char* __restrict__ chunk, i64 chunk_tokens, i64 token_offset, int planes,    \
    i64 row_bytes, i64 block_size, i64 block_stride_rows, i64 plane_stride_rows)                \
{                                                                                               \
    const i64 token = blockIdx.x;                                                               \
    const int lp = blockIdx.y;                                                                  \
    const int layer_rel = lp / planes;                                                          \
    const int plane = lp - layer_rel * planes;                                                  \
    const i64 slot = slots[token];                                                              \
    const i64 paged_row = (slot / block_size) * block_stride_rows                               \
        + plane * plane_stride_rows + slot % block_size;                                        \
    T* dst = (T*)((unsigned char*)layer_ptrs[first_layer + layer_rel] + paged_row * row_bytes); \
    const T* src = (const T*)(chunk                                                             \
        + ((i64)lp * chunk_tokens + token_offset + token) * row_bytes);                         \
    const i64 n = row_bytes / (i64)sizeof(T);                                                   \
    for (i64 i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];                          \
}

KVPOOL_COPY_KERNELS(v16, uint4)
KVPOOL_COPY_KERNELS(v4, unsigned int)
KVPOOL_COPY_KERNELS(v1, unsigned char)
