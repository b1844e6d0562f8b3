// Index math and per-element copy steps for the paged KV transfer kernels.
//
// Torch-free on purpose: this header and paged_copy.cu compile with nvcc alone, and
// the __host__ __device__ steps below are exercised on the host by
// cuda/native_tests/index_math_check.cu (no GPU needed).
//
// Everything is a byte copy in units of V (1, 2, 4, 8 or 16 bytes), so one kernel
// serves every dtype (fp32, fp16, bf16, fp8 stored as uint8).
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

#if defined(__CUDACC__)
#define LMC_HD __host__ __device__ __forceinline__
#else
#define LMC_HD inline
#endif

namespace lmcache_cuda {

// Geometry of the paged layer tensors and of the canonical token buffer, in units
// of the vector type V (not elements, not bytes).
//
// Paged layer (logical [num_blocks, num_heads, block_size, 2 * head_size]):
//   K(blk, off, h) row starts at blk * stride_block + off * stride_token + h * stride_head,
//   V(blk, off, h) row starts row_vecs after it (K is the first head_size, V the second).
// Token buffer [num_layers, 2, num_tokens, num_heads, head_size], contiguous.
struct TokenGeom {
  int64_t num_tokens;
  int64_t num_heads;
  int64_t block_size;
  int64_t num_blocks;
  int64_t row_vecs;      // head_size * elem_size / sizeof(V)
  int64_t stride_block;  // in V units
  int64_t stride_head;   // in V units
  int64_t stride_token;  // in V units
};

// Whole-block geometry: block b of a layer is the dense region
// [b * stride_block, b * stride_block + block_vecs) of that layer (V units).
// Buffer [num_layers, num_ids, block_vecs], contiguous.
struct BlockGeom {
  int64_t num_ids;
  int64_t num_blocks;
  int64_t block_vecs;
  int64_t stride_block;
};

// Work item i of token t in layer l: i runs over [0, 2 * num_heads * row_vecs), ordered
// (head, kv, vec) so that consecutive threads read consecutive bytes of the paged row.
// kGather: paged -> buffer (a negative or out-of-range slot writes zeros);
// otherwise buffer -> paged (a negative or out-of-range slot is skipped).
template <typename V, bool kGather>
LMC_HD void token_copy_step(V* paged, V* buffer, int64_t l, int64_t t, int64_t slot,
                            int64_t i, const TokenGeom& g) {
  const int64_t per_head = 2 * g.row_vecs;
  const int64_t h = i / per_head;
  const int64_t r = i - h * per_head;
  const int64_t kv = r / g.row_vecs;
  const int64_t v = r - kv * g.row_vecs;
  const int64_t buf = ((l * 2 + kv) * g.num_tokens + t) * g.num_heads * g.row_vecs +
                      h * g.row_vecs + v;
  const bool valid = slot >= 0 && slot < g.num_blocks * g.block_size;
  if (!valid) {
    if (kGather) buffer[buf] = V{};
    return;
  }
  const int64_t blk = slot / g.block_size;
  const int64_t off = slot - blk * g.block_size;
  const int64_t src = blk * g.stride_block + off * g.stride_token + h * g.stride_head + r;
  if (kGather) {
    buffer[buf] = paged[src];
  } else {
    paged[src] = buffer[buf];
  }
}

// Vector i of block-id entry n in layer l.
// kGather: paged -> buffer (an out-of-range id writes zeros); otherwise buffer ->
// paged (an out-of-range id is skipped).
template <typename V, bool kGather>
LMC_HD void block_copy_step(V* paged, V* buffer, int64_t l, int64_t n, int64_t block_id,
                            int64_t i, const BlockGeom& g) {
  const int64_t buf = (l * g.num_ids + n) * g.block_vecs + i;
  const bool valid = block_id >= 0 && block_id < g.num_blocks;
  if (!valid) {
    if (kGather) buffer[buf] = V{};
    return;
  }
  const int64_t src = block_id * g.stride_block + i;
  if (kGather) {
    buffer[buf] = paged[src];
  } else {
    paged[src] = buffer[buf];
  }
}

// Largest vector width in bytes (16, 8, 4, 2 or 1) that divides every value given
// (byte strides, row sizes, addresses).
LMC_HD int64_t choose_vec_bytes(const int64_t* values, int n) {
  int64_t w = 16;
  for (int k = 0; k < n; ++k) {
    while (w > 1 && (values[k] % w) != 0) w >>= 1;
  }
  return w;
}

// Host launchers (paged_copy.cu). All sizes in elements of elem_size bytes; pointers
// are device pointers; ptr_align is a power of two dividing every layer base
// address in d_layer_ptrs (the caller knows them on the host).
cudaError_t launch_token_copy(bool gather, const int64_t* d_layer_ptrs, int64_t num_layers,
                              int64_t ptr_align, const int64_t* d_slots, int64_t num_tokens,
                              void* d_buffer, int64_t elem_size, int64_t num_blocks,
                              int64_t num_heads, int64_t block_size, int64_t head_size,
                              int64_t stride_block, int64_t stride_head, int64_t stride_token,
                              cudaStream_t stream);

cudaError_t launch_block_copy(bool gather, const int64_t* d_layer_ptrs, int64_t num_layers,
                              int64_t ptr_align, const int64_t* d_block_ids, int64_t num_ids,
                              void* d_buffer, int64_t elem_size, int64_t num_blocks,
                              int64_t block_numel, int64_t stride_block, cudaStream_t stream);

}  // namespace lmcache_cuda
