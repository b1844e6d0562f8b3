// Host-side driver of the GPU fp8 arithmetic (fp8_math.cuh), no GPU needed: encodes
// or decodes a whole buffer group by group with the same steps the CUDA kernels take
// per warp (the largest magnitude of 64 values, their scale, their codes; or each
// code's value), so tests/cuda/test_native_fp8_math.py can compare the frames and
// values with lmcache_core's CPU codec byte for byte. Build (no CUDA headers needed):
//   c++ -std=c++17 -O1 -ffp-contract=off -I cuda/lmcache_cuda/csrc fp8_math_check.cpp
// Usage:
//   fp8_math_check encode DTYPE N IN OUT INV_MAX_UP MIN_SCALE LIMIT   (IN: N values)
//   fp8_math_check decode DTYPE N IN OUT LIMIT                        (IN: the payload)
// DTYPE: 0 float16, 1 bfloat16, 2 float32. Prints "status S" (0: fine; else the
// status bits of fp8_math.cuh) and exits 0.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "fp8_math.cuh"

using namespace lmcache_cuda::fp8;

static std::vector<uint8_t> read_all(const char* path) {
  std::vector<uint8_t> data;
  FILE* f = std::fopen(path, "rb");
  if (!f) return data;
  uint8_t buf[1 << 16];
  size_t got;
  while ((got = std::fread(buf, 1, sizeof buf, f)) > 0) data.insert(data.end(), buf, buf + got);
  std::fclose(f);
  return data;
}

static void write_all(const char* path, const std::vector<uint8_t>& data) {
  FILE* f = std::fopen(path, "wb");
  if (!f || std::fwrite(data.data(), 1, data.size(), f) != data.size()) {
    std::printf("cannot write %s\n", path);
    std::exit(2);
  }
  std::fclose(f);
}

int main(int argc, char** argv) {
  if (argc < 6) {
    std::printf("usage: see the header of fp8_math_check.cpp\n");
    return 2;
  }
  const std::string mode = argv[1];
  const int dtype = std::atoi(argv[2]);
  const int64_t n = std::atoll(argv[3]);
  const int esize = dtype == kFloat32 ? 4 : 2;
  const int64_t groups = (n + kGroup - 1) / kGroup;
  std::vector<uint8_t> in = read_all(argv[4]);
  int status = 0;
  if (mode == "encode" && argc == 9) {
    if (static_cast<int64_t>(in.size()) != n * esize) return 3;
    const float inv_max_up = std::strtof(argv[6], nullptr);
    const float min_scale = std::strtof(argv[7], nullptr);
    const float limit = std::strtof(argv[8], nullptr);
    std::vector<uint8_t> out(2 * groups + n);
    for (int64_t g = 0; g < groups; ++g) {
      uint32_t top = 0;  // the values past n count as zeros
      for (int64_t i = g * kGroup; i < n && i < (g + 1) * kGroup; ++i) {
        const uint32_t a = to_bits(load_value(in.data(), i, dtype)) & 0x7FFFFFFFu;
        top = a > top ? a : top;
      }
      if (top > 0x7F7FFFFFu) {
        status |= kNotFinite;
        continue;
      }
      const uint16_t sb = scale_bits(top, inv_max_up, min_scale, limit);
      out[2 * g] = static_cast<uint8_t>(sb & 0xFF);
      out[2 * g + 1] = static_cast<uint8_t>(sb >> 8);
      const float r = scale_reciprocal(sb);
      for (int64_t i = g * kGroup; i < n && i < (g + 1) * kGroup; ++i) {
        out[2 * groups + i] = encode_value(load_value(in.data(), i, dtype), r);
      }
    }
    write_all(argv[5], out);
  } else if (mode == "decode" && argc == 7) {
    if (static_cast<int64_t>(in.size()) != 2 * groups + n) return 3;
    const float limit = std::strtof(argv[6], nullptr);
    std::vector<uint8_t> out(n * esize);
    for (int64_t g = 0; g < groups; ++g) {
      const uint16_t sb = static_cast<uint16_t>(in[2 * g] | (in[2 * g + 1] << 8));
      int bad = scale_ok(sb, limit) ? 0 : kBadScale;
      for (int64_t i = g * kGroup; i < n && i < (g + 1) * kGroup; ++i) {
        if (!code_ok(in[2 * groups + i])) bad |= kNanCode;
      }
      status |= bad;
      if (bad) continue;  // the kernels write nothing of a bad group
      const float s = from_bits(static_cast<uint32_t>(sb) << 16);
      for (int64_t i = g * kGroup; i < n && i < (g + 1) * kGroup; ++i) {
        store_value(out.data(), i, dtype, decode_value(in[2 * groups + i], s));
      }
    }
    write_all(argv[5], out);
  } else {
    std::printf("usage: see the header of fp8_math_check.cpp\n");
    return 2;
  }
  std::printf("status %d\n", status);
  return 0;
}
