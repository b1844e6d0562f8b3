// Torch glue for the paged KV transfer kernels: argument checks, device guard,
// current-stream launch. Python callers (lmcache_cuda.kernels) pass the layer base
// addresses as a device int64 tensor so one launch covers every layer.
#include <torch/extension.h>

#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include "fp8_paged.cuh"
#include "paged_copy.cuh"

namespace {

void check_index_tensor(const torch::Tensor& t, const torch::Tensor& buffer, const char* what) {
  TORCH_CHECK(t.is_cuda(), what, " must be a CUDA tensor");
  TORCH_CHECK(t.scalar_type() == torch::kInt64, what, " must be int64, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.is_contiguous(), what, " must be a contiguous 1-D tensor");
  TORCH_CHECK(t.get_device() == buffer.get_device(), what, " is on cuda:", t.get_device(),
              " but the buffer is on cuda:", buffer.get_device());
}

void check_buffer(const torch::Tensor& buffer, int64_t elem_size, int64_t expected_numel) {
  TORCH_CHECK(buffer.is_cuda(), "buffer must be a CUDA tensor (stage host memory in Python)");
  TORCH_CHECK(buffer.is_contiguous(), "buffer must be contiguous");
  TORCH_CHECK(buffer.element_size() == elem_size, "buffer element size ", buffer.element_size(),
              " != KV element size ", elem_size);
  TORCH_CHECK(buffer.numel() == expected_numel, "buffer has ", buffer.numel(),
              " elements, expected ", expected_numel);
}

void token_copy(bool gather, const torch::Tensor& layer_ptrs, int64_t ptr_align,
                const torch::Tensor& slots, torch::Tensor& buffer, int64_t elem_size,
                int64_t num_blocks, int64_t num_heads, int64_t block_size, int64_t head_size,
                int64_t stride_block, int64_t stride_head, int64_t stride_token) {
  check_index_tensor(layer_ptrs, buffer, "layer_ptrs");
  check_index_tensor(slots, buffer, "slot_mapping");
  const int64_t num_layers = layer_ptrs.numel();
  const int64_t num_tokens = slots.numel();
  check_buffer(buffer, elem_size, num_layers * 2 * num_tokens * num_heads * head_size);
  TORCH_CHECK(ptr_align > 0 && (ptr_align & (ptr_align - 1)) == 0,
              "ptr_align must be a power of two, got ", ptr_align);
  const c10::cuda::CUDAGuard guard(buffer.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const cudaError_t err = lmcache_cuda::launch_token_copy(
      gather, layer_ptrs.data_ptr<int64_t>(), num_layers, ptr_align, slots.data_ptr<int64_t>(),
      num_tokens, buffer.data_ptr(), elem_size, num_blocks, num_heads, block_size, head_size,
      stride_block, stride_head, stride_token, stream);
  TORCH_CHECK(err == cudaSuccess, "lmcache_cuda token ", gather ? "gather" : "scatter",
              " launch failed: ", cudaGetErrorString(err));
}

void block_copy(bool gather, const torch::Tensor& layer_ptrs, int64_t ptr_align,
                const torch::Tensor& block_ids, torch::Tensor& buffer, int64_t elem_size,
                int64_t num_blocks, int64_t block_numel, int64_t stride_block) {
  check_index_tensor(layer_ptrs, buffer, "layer_ptrs");
  check_index_tensor(block_ids, buffer, "block_ids");
  const int64_t num_layers = layer_ptrs.numel();
  const int64_t num_ids = block_ids.numel();
  check_buffer(buffer, elem_size, num_layers * num_ids * block_numel);
  TORCH_CHECK(ptr_align > 0 && (ptr_align & (ptr_align - 1)) == 0,
              "ptr_align must be a power of two, got ", ptr_align);
  const c10::cuda::CUDAGuard guard(buffer.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const cudaError_t err = lmcache_cuda::launch_block_copy(
      gather, layer_ptrs.data_ptr<int64_t>(), num_layers, ptr_align,
      block_ids.data_ptr<int64_t>(), num_ids, buffer.data_ptr(), elem_size, num_blocks,
      block_numel, stride_block, stream);
  TORCH_CHECK(err == cudaSuccess, "lmcache_cuda block ", gather ? "gather" : "scatter",
              " launch failed: ", cudaGetErrorString(err));
}

void gather_tokens(torch::Tensor layer_ptrs, int64_t ptr_align, torch::Tensor slots,
                   torch::Tensor buffer, int64_t elem_size, int64_t num_blocks,
                   int64_t num_heads, int64_t block_size, int64_t head_size,
                   int64_t stride_block, int64_t stride_head, int64_t stride_token) {
  token_copy(true, layer_ptrs, ptr_align, slots, buffer, elem_size, num_blocks, num_heads,
             block_size, head_size, stride_block, stride_head, stride_token);
}

void scatter_tokens(torch::Tensor layer_ptrs, int64_t ptr_align, torch::Tensor slots,
                    torch::Tensor buffer, int64_t elem_size, int64_t num_blocks,
                    int64_t num_heads, int64_t block_size, int64_t head_size,
                    int64_t stride_block, int64_t stride_head, int64_t stride_token) {
  token_copy(false, layer_ptrs, ptr_align, slots, buffer, elem_size, num_blocks, num_heads,
             block_size, head_size, stride_block, stride_head, stride_token);
}

void gather_blocks(torch::Tensor layer_ptrs, int64_t ptr_align, torch::Tensor block_ids,
                   torch::Tensor buffer, int64_t elem_size, int64_t num_blocks,
                   int64_t block_numel, int64_t stride_block) {
  block_copy(true, layer_ptrs, ptr_align, block_ids, buffer, elem_size, num_blocks, block_numel,
             stride_block);
}

void scatter_blocks(torch::Tensor layer_ptrs, int64_t ptr_align, torch::Tensor block_ids,
                    torch::Tensor buffer, int64_t elem_size, int64_t num_blocks,
                    int64_t block_numel, int64_t stride_block) {
  block_copy(false, layer_ptrs, ptr_align, block_ids, buffer, elem_size, num_blocks, block_numel,
             stride_block);
}

// Checks shared by the byte-range copies: every tensor contiguous, on the CPU or on
// one CUDA device (returned in `device`), each segment inside its tensors (a segment
// spans `extent[i]` bytes from its offset). Returns "" or what is wrong.
std::string check_segments(const char* fn, const std::vector<torch::Tensor>& dsts,
                           const std::vector<int64_t>& dst_off,
                           const std::vector<int64_t>& dst_extent,
                           const std::vector<torch::Tensor>& srcs,
                           const std::vector<int64_t>& src_off,
                           const std::vector<int64_t>& src_extent, int& device) {
  const std::string name(fn);
  const size_t n = dst_extent.size();
  if (dsts.size() != n || dst_off.size() != n || srcs.size() != n || src_off.size() != n ||
      src_extent.size() != n) {
    return name + ": lists of different lengths";
  }
  device = -1;
  for (size_t i = 0; i < n; ++i) {
    for (const torch::Tensor* t : {&dsts[i], &srcs[i]}) {
      if (!t->is_contiguous()) return name + ": segment " + std::to_string(i) + " has a non-contiguous tensor";
      if (t->is_cuda()) {
        if (device >= 0 && device != t->get_device()) return name + ": tensors on several CUDA devices";
        device = t->get_device();
      } else if (!t->is_cpu()) {
        return name + ": segment " + std::to_string(i) + " is neither CPU nor CUDA";
      }
    }
    const int64_t dn = static_cast<int64_t>(dsts[i].nbytes());
    const int64_t sn = static_cast<int64_t>(srcs[i].nbytes());
    if (dst_extent[i] < 0 || src_extent[i] < 0 || dst_off[i] < 0 || src_off[i] < 0 ||
        dst_off[i] + dst_extent[i] > dn || src_off[i] + src_extent[i] > sn) {
      return name + ": segment " + std::to_string(i) + " is outside its tensors";
    }
  }
  if (n > 0 && device < 0) return name + ": no CUDA tensor among the segments";
  return "";
}

// Byte-range copies between contiguous tensors (host and/or device), all enqueued on
// the current stream in one call: segment i copies nbytes[i] bytes from
// srcs[i] + src_off[i] to dsts[i] + dst_off[i]. For callers that move many small
// slices per step (one layer of several chunks), where a Python-level copy per slice
// costs more host time than the copy engine takes.
std::string copy_segments(const std::vector<torch::Tensor>& dsts,
                          const std::vector<int64_t>& dst_off,
                          const std::vector<torch::Tensor>& srcs,
                          const std::vector<int64_t>& src_off,
                          const std::vector<int64_t>& nbytes) {
  // Returns "" or what is wrong (the Python wrapper raises it): an exception thrown
  // out of this extension was seen to crash the process (torch 2.11, JIT build).
  int device = -1;
  std::string err = check_segments("copy_segments", dsts, dst_off, nbytes, srcs, src_off, nbytes, device);
  if (!err.empty() || nbytes.empty()) return err;
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  for (size_t i = 0; i < nbytes.size(); ++i) {
    if (nbytes[i] == 0) continue;
    char* dst = static_cast<char*>(dsts[i].data_ptr()) + dst_off[i];
    const char* src = static_cast<const char*>(srcs[i].data_ptr()) + src_off[i];
    const cudaError_t e =
        cudaMemcpyAsync(dst, src, static_cast<size_t>(nbytes[i]), cudaMemcpyDefault, stream);
    if (e != cudaSuccess) {
      return "copy_segments: segment " + std::to_string(i) + ": " + cudaGetErrorString(e);
    }
  }
  return "";
}

// The same with `rows` rows of `width` bytes per segment, `dst_pitch` / `src_pitch`
// bytes apart (one cudaMemcpy2DAsync each): e.g. the K and V halves of a chunk's layer
// in one DMA. rows == 1 is a plain copy.
std::string copy_rows(const std::vector<torch::Tensor>& dsts, const std::vector<int64_t>& dst_off,
                      const std::vector<int64_t>& dst_pitch,
                      const std::vector<torch::Tensor>& srcs, const std::vector<int64_t>& src_off,
                      const std::vector<int64_t>& src_pitch, const std::vector<int64_t>& width,
                      const std::vector<int64_t>& rows) {
  const size_t n = width.size();
  if (dst_pitch.size() != n || src_pitch.size() != n || rows.size() != n) {
    return "copy_rows: lists of different lengths";
  }
  std::vector<int64_t> dst_extent(n), src_extent(n);
  for (size_t i = 0; i < n; ++i) {
    if (rows[i] < 0 || width[i] < 0 || (rows[i] > 1 && (dst_pitch[i] < width[i] || src_pitch[i] < width[i]))) {
      return "copy_rows: segment " + std::to_string(i) + " has rows wider than their pitch";
    }
    dst_extent[i] = rows[i] == 0 ? 0 : (rows[i] - 1) * dst_pitch[i] + width[i];
    src_extent[i] = rows[i] == 0 ? 0 : (rows[i] - 1) * src_pitch[i] + width[i];
  }
  int device = -1;
  std::string err = check_segments("copy_rows", dsts, dst_off, dst_extent, srcs, src_off, src_extent, device);
  if (!err.empty() || n == 0) return err;
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  for (size_t i = 0; i < n; ++i) {
    if (rows[i] == 0 || width[i] == 0) continue;
    char* dst = static_cast<char*>(dsts[i].data_ptr()) + dst_off[i];
    const char* src = static_cast<const char*>(srcs[i].data_ptr()) + src_off[i];
    const cudaError_t e =
        rows[i] == 1
            ? cudaMemcpyAsync(dst, src, static_cast<size_t>(width[i]), cudaMemcpyDefault, stream)
            : cudaMemcpy2DAsync(dst, static_cast<size_t>(dst_pitch[i]), src, static_cast<size_t>(src_pitch[i]),
                                static_cast<size_t>(width[i]), static_cast<size_t>(rows[i]),
                                cudaMemcpyDefault, stream);
    if (e != cudaSuccess) {
      return "copy_rows: segment " + std::to_string(i) + ": " + cudaGetErrorString(e);
    }
  }
  return "";
}

// fp8 frames coded on the GPU (fp8_paged.cuh). Geometry as the token/block copies take
// it; `tokens` picks the chunk buffer's layout. Returns "" or what is wrong (the
// Python wrapper raises it), never throws.
std::string fp8_check(const torch::Tensor& layer_ptrs, const torch::Tensor& index,
                      const torch::Tensor& payload, const torch::Tensor& status,
                      lmcache_cuda::Fp8Geom& g, bool tokens, int64_t dtype, int64_t g_begin,
                      int64_t g_end) {
  for (const torch::Tensor* t : {&layer_ptrs, &index}) {
    if (!t->is_cuda() || t->scalar_type() != torch::kInt64 || t->dim() != 1 || !t->is_contiguous()) {
      return "fp8: layer table and index must be contiguous 1-D int64 CUDA tensors";
    }
  }
  if (!payload.is_cuda() || payload.scalar_type() != torch::kUInt8 || !payload.is_contiguous()) {
    return "fp8: the frame must be a contiguous uint8 CUDA tensor";
  }
  if (!status.is_cuda() || status.scalar_type() != torch::kInt32 || status.numel() < 1) {
    return "fp8: status must be an int32 CUDA tensor";
  }
  const int dev = payload.get_device();
  if (layer_ptrs.get_device() != dev || index.get_device() != dev || status.get_device() != dev) {
    return "fp8: tensors on several CUDA devices";
  }
  if (dtype < 0 || dtype > 2) return "fp8: dtype code must be 0 (float16), 1 (bfloat16) or 2 (float32)";
  const int64_t layers = layer_ptrs.numel();
  g.num_index = index.numel();
  if (g.num_heads < 0 || g.head_size < 0 || g.block_numel < 0 || g.block_size <= 0 || g.num_blocks < 0) {
    return "fp8: negative geometry";
  }
  if (tokens) {
    if (g.num_heads == 0 || g.head_size == 0) return "fp8: no heads or head size 0";
    g.n = layers * 2 * g.num_index * g.num_heads * g.head_size;
  } else {
    if (g.block_numel == 0) return "fp8: block_numel is 0";
    g.n = layers * g.num_index * g.block_numel;
  }
  g.groups = (g.n + lmcache_cuda::fp8::kGroup - 1) / lmcache_cuda::fp8::kGroup;
  if (payload.numel() != 2 * g.groups + g.n) {
    return "fp8: the frame has " + std::to_string(payload.numel()) + " bytes, " +
           std::to_string(2 * g.groups + g.n) + " expected for " + std::to_string(g.n) + " values";
  }
  if (g_begin < 0 || g_begin > g_end || g_end > g.groups) return "fp8: group range outside the frame";
  return "";
}

std::string fp8_scatter(torch::Tensor layer_ptrs, torch::Tensor index, torch::Tensor payload,
                        torch::Tensor status, bool tokens, int64_t num_heads, int64_t head_size,
                        int64_t block_size, int64_t num_blocks, int64_t stride_block,
                        int64_t stride_head, int64_t stride_token, int64_t block_numel,
                        int64_t dtype, double limit, int64_t g_begin, int64_t g_end) {
  lmcache_cuda::Fp8Geom g{0, 0, 0, num_heads, head_size, block_size, num_blocks, stride_block,
                          stride_head, stride_token, block_numel};
  std::string err = fp8_check(layer_ptrs, index, payload, status, g, tokens, dtype, g_begin, g_end);
  if (!err.empty()) return err;
  const c10::cuda::CUDAGuard guard(payload.device());
  const cudaError_t e = lmcache_cuda::launch_fp8_decode(
      tokens, layer_ptrs.data_ptr<int64_t>(), index.data_ptr<int64_t>(), payload.data_ptr<uint8_t>(), g,
      static_cast<int>(dtype), static_cast<float>(limit), g_begin, g_end, status.data_ptr<int>(),
      c10::cuda::getCurrentCUDAStream().stream());
  return e == cudaSuccess ? "" : std::string("fp8 decode launch failed: ") + cudaGetErrorString(e);
}

std::string fp8_gather(torch::Tensor layer_ptrs, torch::Tensor index, torch::Tensor payload,
                       torch::Tensor status, bool tokens, int64_t num_heads, int64_t head_size,
                       int64_t block_size, int64_t num_blocks, int64_t stride_block,
                       int64_t stride_head, int64_t stride_token, int64_t block_numel,
                       int64_t dtype, double inv_max_up, double min_scale, double limit,
                       int64_t g_begin, int64_t g_end) {
  lmcache_cuda::Fp8Geom g{0, 0, 0, num_heads, head_size, block_size, num_blocks, stride_block,
                          stride_head, stride_token, block_numel};
  std::string err = fp8_check(layer_ptrs, index, payload, status, g, tokens, dtype, g_begin, g_end);
  if (!err.empty()) return err;
  const c10::cuda::CUDAGuard guard(payload.device());
  const cudaError_t e = lmcache_cuda::launch_fp8_encode(
      tokens, layer_ptrs.data_ptr<int64_t>(), index.data_ptr<int64_t>(), payload.data_ptr<uint8_t>(), g,
      static_cast<int>(dtype), static_cast<float>(inv_max_up), static_cast<float>(min_scale),
      static_cast<float>(limit), g_begin, g_end, status.data_ptr<int>(),
      c10::cuda::getCurrentCUDAStream().stream());
  return e == cudaSuccess ? "" : std::string("fp8 encode launch failed: ") + cudaGetErrorString(e);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lmcache_cuda paged KV transfer kernels (gather/scatter tokens, copy blocks)";
  m.def("gather_tokens", &gather_tokens, "paged KV -> [L, 2, T, H, D] buffer (device)");
  m.def("scatter_tokens", &scatter_tokens, "[L, 2, T, H, D] buffer (device) -> paged KV");
  m.def("gather_blocks", &gather_blocks, "paged KV blocks -> [L, N, block_numel] buffer");
  m.def("scatter_blocks", &scatter_blocks, "[L, N, block_numel] buffer -> paged KV blocks");
  m.def("copy_segments", &copy_segments, "byte-range copies between tensors, one call, current stream");
  m.def("copy_rows", &copy_rows, "copy_segments with rows of bytes at a pitch (2-D copies), one call");
  m.def("fp8_scatter", &fp8_scatter, "decode an fp8 frame (device) into paged KV, groups [begin, end)");
  m.def("fp8_gather", &fp8_gather, "gather paged KV and encode it into an fp8 frame (device), groups [begin, end)");
}
