// Paged KV transfer kernels: token gather/scatter and whole-block copy across all
// layers in one launch. Torch-free (see paged_copy.cuh); the torch glue is ops.cpp.
#include "paged_copy.cuh"

namespace lmcache_cuda {
namespace {

constexpr int64_t kMaxThreads = 256;
constexpr int64_t kMaxGridYZ = 65535;
constexpr int64_t kMaxGridX = 2147483647;

template <typename V, bool kGather>
__global__ void token_copy_kernel(const int64_t* __restrict__ layer_ptrs,
                                  const int64_t* __restrict__ slots, V* buffer, TokenGeom g) {
  const int64_t t = blockIdx.x;
  const int64_t l = blockIdx.y;
  V* paged = reinterpret_cast<V*>(layer_ptrs[l]);
  const int64_t slot = slots[t];
  const int64_t work = 2 * g.num_heads * g.row_vecs;
  for (int64_t i = threadIdx.x; i < work; i += blockDim.x) {
    token_copy_step<V, kGather>(paged, buffer, l, t, slot, i, g);
  }
}

template <typename V, bool kGather>
__global__ void block_copy_kernel(const int64_t* __restrict__ layer_ptrs,
                                  const int64_t* __restrict__ block_ids, V* buffer, BlockGeom g,
                                  int64_t seg_vecs) {
  const int64_t n = blockIdx.x;
  const int64_t l = blockIdx.y;
  const int64_t begin = static_cast<int64_t>(blockIdx.z) * seg_vecs;
  const int64_t end = begin + seg_vecs < g.block_vecs ? begin + seg_vecs : g.block_vecs;
  V* paged = reinterpret_cast<V*>(layer_ptrs[l]);
  const int64_t block_id = block_ids[n];
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    block_copy_step<V, kGather>(paged, buffer, l, n, block_id, i, g);
  }
}

int64_t threads_for(int64_t work) {
  int64_t t = (work + 31) / 32 * 32;
  if (t < 32) t = 32;
  if (t > kMaxThreads) t = kMaxThreads;
  return t;
}

template <typename V, bool kGather>
cudaError_t run_token(const int64_t* ptrs, int64_t num_layers, const int64_t* slots,
                      void* buffer, TokenGeom g, cudaStream_t stream) {
  const int64_t work = 2 * g.num_heads * g.row_vecs;
  dim3 grid(static_cast<unsigned>(g.num_tokens), static_cast<unsigned>(num_layers), 1);
  dim3 block(static_cast<unsigned>(threads_for(work)), 1, 1);
  token_copy_kernel<V, kGather><<<grid, block, 0, stream>>>(ptrs, slots,
                                                              static_cast<V*>(buffer), g);
  return cudaGetLastError();
}

template <typename V, bool kGather>
cudaError_t run_block(const int64_t* ptrs, int64_t num_layers, const int64_t* ids, void* buffer,
                      BlockGeom g, cudaStream_t stream) {
  const int64_t threads = threads_for(g.block_vecs);
  int64_t seg_vecs = threads * 8;
  int64_t segs = (g.block_vecs + seg_vecs - 1) / seg_vecs;
  if (segs > kMaxGridYZ) {
    segs = kMaxGridYZ;
    seg_vecs = (g.block_vecs + segs - 1) / segs;
  }
  dim3 grid(static_cast<unsigned>(g.num_ids), static_cast<unsigned>(num_layers),
            static_cast<unsigned>(segs));
  dim3 block(static_cast<unsigned>(threads), 1, 1);
  block_copy_kernel<V, kGather><<<grid, block, 0, stream>>>(ptrs, ids, static_cast<V*>(buffer),
                                                              g, seg_vecs);
  return cudaGetLastError();
}

template <bool kGather>
cudaError_t token_dispatch(int64_t vec, const int64_t* ptrs, int64_t num_layers,
                           const int64_t* slots, void* buffer, TokenGeom g,
                           cudaStream_t stream) {
  switch (vec) {
    case 16: return run_token<uint4, kGather>(ptrs, num_layers, slots, buffer, g, stream);
    case 8: return run_token<uint2, kGather>(ptrs, num_layers, slots, buffer, g, stream);
    case 4: return run_token<uint32_t, kGather>(ptrs, num_layers, slots, buffer, g, stream);
    case 2: return run_token<uint16_t, kGather>(ptrs, num_layers, slots, buffer, g, stream);
    default: return run_token<uint8_t, kGather>(ptrs, num_layers, slots, buffer, g, stream);
  }
}

template <bool kGather>
cudaError_t block_dispatch(int64_t vec, const int64_t* ptrs, int64_t num_layers,
                           const int64_t* ids, void* buffer, BlockGeom g, cudaStream_t stream) {
  switch (vec) {
    case 16: return run_block<uint4, kGather>(ptrs, num_layers, ids, buffer, g, stream);
    case 8: return run_block<uint2, kGather>(ptrs, num_layers, ids, buffer, g, stream);
    case 4: return run_block<uint32_t, kGather>(ptrs, num_layers, ids, buffer, g, stream);
    case 2: return run_block<uint16_t, kGather>(ptrs, num_layers, ids, buffer, g, stream);
    default: return run_block<uint8_t, kGather>(ptrs, num_layers, ids, buffer, g, stream);
  }
}

}  // namespace

cudaError_t launch_token_copy(bool gather, const int64_t* d_layer_ptrs, int64_t num_layers,
                              int64_t ptr_align, const int64_t* d_slots, int64_t num_tokens,
                              void* d_buffer, int64_t elem_size, int64_t num_blocks,
                              int64_t num_heads, int64_t block_size, int64_t head_size,
                              int64_t stride_block, int64_t stride_head, int64_t stride_token,
                              cudaStream_t stream) {
  if (num_layers == 0 || num_tokens == 0 || num_heads == 0 || head_size == 0) {
    return cudaSuccess;
  }
  if (num_layers > kMaxGridYZ || num_tokens > kMaxGridX) return cudaErrorInvalidValue;
  const int64_t vals[6] = {head_size * elem_size, stride_block * elem_size,
                           stride_head * elem_size, stride_token * elem_size, ptr_align,
                           static_cast<int64_t>(reinterpret_cast<uintptr_t>(d_buffer))};
  const int64_t vec = choose_vec_bytes(vals, 6);
  TokenGeom g;
  g.num_tokens = num_tokens;
  g.num_heads = num_heads;
  g.block_size = block_size;
  g.num_blocks = num_blocks;
  g.row_vecs = head_size * elem_size / vec;
  g.stride_block = stride_block * elem_size / vec;
  g.stride_head = stride_head * elem_size / vec;
  g.stride_token = stride_token * elem_size / vec;
  if (gather) return token_dispatch<true>(vec, d_layer_ptrs, num_layers, d_slots, d_buffer, g, stream);
  return token_dispatch<false>(vec, d_layer_ptrs, num_layers, d_slots, d_buffer, g, stream);
}

cudaError_t launch_block_copy(bool gather, const int64_t* d_layer_ptrs, int64_t num_layers,
                              int64_t ptr_align, const int64_t* d_block_ids, int64_t num_ids,
                              void* d_buffer, int64_t elem_size, int64_t num_blocks,
                              int64_t block_numel, int64_t stride_block, cudaStream_t stream) {
  if (num_layers == 0 || num_ids == 0 || block_numel == 0) return cudaSuccess;
  if (num_layers > kMaxGridYZ || num_ids > kMaxGridX) return cudaErrorInvalidValue;
  const int64_t vals[4] = {block_numel * elem_size, stride_block * elem_size, ptr_align,
                           static_cast<int64_t>(reinterpret_cast<uintptr_t>(d_buffer))};
  const int64_t vec = choose_vec_bytes(vals, 4);
  BlockGeom g;
  g.num_ids = num_ids;
  g.num_blocks = num_blocks;
  g.block_vecs = block_numel * elem_size / vec;
  g.stride_block = stride_block * elem_size / vec;
  if (gather) return block_dispatch<true>(vec, d_layer_ptrs, num_layers, d_block_ids, d_buffer, g, stream);
  return block_dispatch<false>(vec, d_layer_ptrs, num_layers, d_block_ids, d_buffer, g, stream);
}

}  // namespace lmcache_cuda
