// kvpool's copy kernel: one CTA per segment of a copy table, each segment copied in 16-byte
// words by the CTA's threads (four words in flight per thread). Used for a job's pages when
// they are small and scattered (a batched DMA then pays per copy); host memory is read or
// written in place (registered, device-mapped). Every address and length is a multiple of 16
// (checked by the engine before it chooses this kernel).
//
// copy_segments.ptx beside this file is generated from it (the engine loads the PTX; the
// driver compiles it for the device at load time):
//   nvcc -ptx -arch=compute_75 -o copy_segments.ptx copy_segments.cu
// then `.version` lowered to 7.5 (nothing newer is used), so drivers from CUDA 11.5 on load it;
// checked with `ptxas -arch=sm_90`.

struct Segment {
    unsigned long long src, dst, len;
};

extern "C" __global__ void kvpool_copy_segments(const Segment* table, unsigned int count) {
    unsigned int i = blockIdx.x;
    if (i >= count) return;
    Segment s = table[i];
    const uint4* src = (const uint4*)s.src;
    uint4* dst = (uint4*)s.dst;
    unsigned long long words = s.len / 16;
    unsigned long long step = blockDim.x;
    unsigned long long w = threadIdx.x;
    for (; w + 3 * step < words; w += 4 * step) {
        uint4 a = src[w], b = src[w + step], c = src[w + 2 * step], d = src[w + 3 * step];
        dst[w] = a;
        dst[w + step] = b;
        dst[w + 2 * step] = c;
        dst[w + 3 * step] = d;
    }
    for (; w < words; w += step) dst[w] = src[w];
}
