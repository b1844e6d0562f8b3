// fp8 decode + scatter and gather + encode kernels (see fp8_paged.cuh). One warp per
// group of 64 values: lane k holds values k and k + 32 of the group, so a warp reads
// and writes two runs of 32 consecutive values (consecutive addresses within a
// head's row of the paged tensor); the group's largest magnitude is a warp
// reduction, its scale computed by every lane alike.
#include "fp8_paged.cuh"

namespace lmcache_cuda {
namespace {

using namespace fp8;

constexpr int kThreads = 256;  // 8 warps: 8 groups a block
constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ uint32_t warp_max(uint32_t v) {
  for (int o = 16; o > 0; o >>= 1) {
    const uint32_t w = __shfl_xor_sync(0xFFFFFFFFu, v, o);
    v = w > v ? w : v;
  }
  return v;
}

__device__ __forceinline__ int warp_or(int v) {
  for (int o = 16; o > 0; o >>= 1) v |= __shfl_xor_sync(0xFFFFFFFFu, v, o);
  return v;
}

template <bool kTokens, typename I>
__global__ void fp8_decode_kernel(const int64_t* __restrict__ layer_ptrs,
                                  const int64_t* __restrict__ index,
                                  const uint8_t* __restrict__ payload, Fp8Geom g, int dtype,
                                  float limit, int64_t g_begin, int64_t g_end,
                                  int* __restrict__ status) {
  const int64_t grp = g_begin + static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (grp >= g_end) return;  // whole warps leave together
  const int lane = threadIdx.x & 31;
  const uint16_t sb = static_cast<uint16_t>(payload[2 * grp] | (payload[2 * grp + 1] << 8));
  const uint8_t* codes = payload + 2 * g.groups;
  const int64_t j0 = grp * kGroup + lane, j1 = j0 + 32;
  const uint8_t c0 = j0 < g.n ? codes[j0] : 0, c1 = j1 < g.n ? codes[j1] : 0;
  int bad = scale_ok(sb, limit) ? 0 : kBadScale;
  if (!code_ok(c0) || !code_ok(c1)) bad |= kNanCode;
  bad = warp_or(bad);
  if (bad) {
    if (lane == 0) atomicOr(status, bad);
    return;
  }
  const float s = from_bits(static_cast<uint32_t>(sb) << 16);
  int64_t layer = 0;
  if (j0 < g.n) {
    const int64_t at = fp8_locate<kTokens, I>(index, j0, g, &layer);
    if (at >= 0) store_value(reinterpret_cast<void*>(layer_ptrs[layer]), at, dtype, decode_value(c0, s));
  }
  if (j1 < g.n) {
    const int64_t at = fp8_locate<kTokens, I>(index, j1, g, &layer);
    if (at >= 0) store_value(reinterpret_cast<void*>(layer_ptrs[layer]), at, dtype, decode_value(c1, s));
  }
}

template <bool kTokens, typename I>
__global__ void fp8_encode_kernel(const int64_t* __restrict__ layer_ptrs,
                                  const int64_t* __restrict__ index, uint8_t* __restrict__ payload,
                                  Fp8Geom g, int dtype, float inv_max_up, float min_scale,
                                  float limit, int64_t g_begin, int64_t g_end,
                                  int* __restrict__ status) {
  const int64_t grp = g_begin + static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (grp >= g_end) return;
  const int lane = threadIdx.x & 31;
  const int64_t j0 = grp * kGroup + lane, j1 = j0 + 32;
  float v0 = 0.0f, v1 = 0.0f;  // past n, and at padding slots: zeros, as the CPU path gathers
  int64_t layer = 0;
  if (j0 < g.n) {
    const int64_t at = fp8_locate<kTokens, I>(index, j0, g, &layer);
    if (at >= 0) v0 = load_value(reinterpret_cast<const void*>(layer_ptrs[layer]), at, dtype);
  }
  if (j1 < g.n) {
    const int64_t at = fp8_locate<kTokens, I>(index, j1, g, &layer);
    if (at >= 0) v1 = load_value(reinterpret_cast<const void*>(layer_ptrs[layer]), at, dtype);
  }
  const uint32_t a0 = to_bits(v0) & 0x7FFFFFFFu, a1 = to_bits(v1) & 0x7FFFFFFFu;
  const uint32_t top = warp_max(a0 > a1 ? a0 : a1);
  if (top > 0x7F7FFFFFu) {  // NaN or infinity in the group
    if (lane == 0) atomicOr(status, kNotFinite);
    return;
  }
  const uint16_t sb = scale_bits(top, inv_max_up, min_scale, limit);
  const float r = scale_reciprocal(sb);
  uint8_t* codes = payload + 2 * g.groups;
  if (j0 < g.n) codes[j0] = encode_value(v0, r);
  if (j1 < g.n) codes[j1] = encode_value(v1, r);
  if (lane == 0) {
    payload[2 * grp] = static_cast<uint8_t>(sb & 0xFF);
    payload[2 * grp + 1] = static_cast<uint8_t>(sb >> 8);
  }
}

bool grid_for(int64_t g_begin, int64_t g_end, dim3* grid) {
  const int64_t blocks = (g_end - g_begin + kWarps - 1) / kWarps;
  if (blocks > 2147483647) return false;
  *grid = dim3(static_cast<unsigned>(blocks), 1, 1);
  return true;
}

}  // namespace

cudaError_t launch_fp8_decode(bool tokens, const int64_t* d_layer_ptrs, const int64_t* d_index,
                              const uint8_t* d_payload, const Fp8Geom& g, int dtype, float limit,
                              int64_t g_begin, int64_t g_end, int* d_status, cudaStream_t stream) {
  if (g_end <= g_begin) return cudaSuccess;
  dim3 grid;
  if (!grid_for(g_begin, g_end, &grid)) return cudaErrorInvalidValue;
  const bool small = fp8_small_index(g);
#define LMC_DECODE(T, I)                                                                   \
  fp8_decode_kernel<T, I><<<grid, kThreads, 0, stream>>>(d_layer_ptrs, d_index, d_payload, g, \
                                                         dtype, limit, g_begin, g_end, d_status)
  if (tokens && small) LMC_DECODE(true, uint32_t);
  else if (tokens) LMC_DECODE(true, int64_t);
  else if (small) LMC_DECODE(false, uint32_t);
  else LMC_DECODE(false, int64_t);
#undef LMC_DECODE
  return cudaGetLastError();
}

cudaError_t launch_fp8_encode(bool tokens, const int64_t* d_layer_ptrs, const int64_t* d_index,
                              uint8_t* d_payload, const Fp8Geom& g, int dtype, float inv_max_up,
                              float min_scale, float limit, int64_t g_begin, int64_t g_end,
                              int* d_status, cudaStream_t stream) {
  if (g_end <= g_begin) return cudaSuccess;
  dim3 grid;
  if (!grid_for(g_begin, g_end, &grid)) return cudaErrorInvalidValue;
  const bool small = fp8_small_index(g);
#define LMC_ENCODE(T, I)                                                                     \
  fp8_encode_kernel<T, I><<<grid, kThreads, 0, stream>>>(d_layer_ptrs, d_index, d_payload, g,   \
                                                         dtype, inv_max_up, min_scale, limit, \
                                                         g_begin, g_end, d_status)
  if (tokens && small) LMC_ENCODE(true, uint32_t);
  else if (tokens) LMC_ENCODE(true, int64_t);
  else if (small) LMC_ENCODE(false, uint32_t);
  else LMC_ENCODE(false, int64_t);
#undef LMC_ENCODE
  return cudaGetLastError();
}

}  // namespace lmcache_cuda
