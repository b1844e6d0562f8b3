// fp8 frames coded on the GPU, straight between a frame's bytes in device memory and
// vLLM's paged KV: decode + scatter in one launch (a load), gather + encode in one
// launch (a save). The frame is the one lmcache_core's fp8 codec writes for the chunk
// buffer (tokens: [layers, 2, tokens, heads, head_size]; blocks: [layers, ids,
// block_numel]): scales first, then one code per value; fp8_math.cuh holds the
// arithmetic, bit for bit the CPU codec's. Torch-free (the glue is ops.cpp).
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

#include "fp8_math.cuh"

namespace lmcache_cuda {

// Where the chunk buffer's values live in the paged layer tensors (element units).
struct Fp8Geom {
  int64_t n;            // values in the chunk buffer
  int64_t groups;       // ceil(n / 64): scales in the frame
  int64_t num_index;    // tokens (slot mapping) or block ids
  int64_t num_heads;    // tokens
  int64_t head_size;    // tokens
  int64_t block_size;   // tokens: slots per block
  int64_t num_blocks;
  int64_t stride_block;
  int64_t stride_head;   // tokens
  int64_t stride_token;  // tokens
  int64_t block_numel;   // blocks
};

// Value j of the chunk buffer: its layer (in *layer) and its element offset in that
// layer's tensor, or -1 where its slot or block id is outside the cache (padding): a
// gather reads zero there, a scatter writes nothing. I is the type the divisions run
// in: uint32_t where fp8_small_index() holds (a 32-bit division costs a fraction of a
// 64-bit one on a GPU), else int64_t; offsets are always computed in 64 bits.
template <bool kTokens, typename I>
LMC_HD int64_t fp8_locate(const int64_t* index, int64_t j, const Fp8Geom& g, int64_t* layer) {
  if (kTokens) {
    const I jj = static_cast<I>(j), hs = static_cast<I>(g.head_size), nh = static_cast<I>(g.num_heads);
    const I ni = static_cast<I>(g.num_index);
    const I d = jj % hs;
    I r = jj / hs;
    const I h = r % nh;
    r /= nh;
    const I t = r % ni;
    r /= ni;
    const int64_t kv = static_cast<int64_t>(r & 1);
    *layer = static_cast<int64_t>(r >> 1);
    const int64_t slot = index[t];
    if (slot < 0 || slot >= g.num_blocks * g.block_size) return -1;
    const I bs = static_cast<I>(g.block_size);
    const I blk = static_cast<I>(slot) / bs;
    const I off = static_cast<I>(slot) - blk * bs;
    return static_cast<int64_t>(blk) * g.stride_block + static_cast<int64_t>(off) * g.stride_token +
           static_cast<int64_t>(h) * g.stride_head + kv * g.head_size + static_cast<int64_t>(d);
  }
  const I jj = static_cast<I>(j), bn = static_cast<I>(g.block_numel), ni = static_cast<I>(g.num_index);
  const I i = jj % bn;
  const I r = jj / bn;
  const I nid = r % ni;
  *layer = static_cast<int64_t>(r / ni);
  const int64_t id = index[nid];
  if (id < 0 || id >= g.num_blocks) return -1;
  return id * g.stride_block + static_cast<int64_t>(i);
}

// The chunk's value indices and the cache's slots fit 32 bits
LMC_HD bool fp8_small_index(const Fp8Geom& g) {
  return g.n < (int64_t{1} << 32) && g.num_blocks * g.block_size < (int64_t{1} << 32);
}

// Decodes groups [g_begin, g_end) of the frame at d_payload (device memory) into the
// paged layers; a group with a bad scale or a NaN code is not written and its fault
// is or-ed into *d_status (fp8::kBadScale, fp8::kNanCode).
cudaError_t launch_fp8_decode(bool tokens, const int64_t* d_layer_ptrs, const int64_t* d_index,
                              const uint8_t* d_payload, const Fp8Geom& g, int dtype, float limit,
                              int64_t g_begin, int64_t g_end, int* d_status, cudaStream_t stream);

// Gathers and encodes groups [g_begin, g_end) into the frame at d_payload; a group
// holding NaN or infinity sets fp8::kNotFinite in *d_status (the frame is then not
// one to store).
cudaError_t launch_fp8_encode(bool tokens, const int64_t* d_layer_ptrs, const int64_t* d_index,
                              uint8_t* d_payload, const Fp8Geom& g, int dtype, float inv_max_up,
                              float min_scale, float limit, int64_t g_begin, int64_t g_end,
                              int* d_status, cudaStream_t stream);

}  // namespace lmcache_cuda
