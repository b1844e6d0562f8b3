// Host-side check of the kernels' index math (no GPU needed).
//
// Runs the same __host__ __device__ steps the CUDA kernels run (paged_copy.cuh), one
// "thread" at a time, for every vector width, contiguous and permuted layouts, ragged
// and invalid slots, and compares the bytes with a naive byte-by-byte model of the
// layouts. Built and run by tests/cuda/test_native_index_math.py:
//   g++ -std=c++17 -I<cuda>/include -I cuda/lmcache_cuda/csrc index_math_check.cpp
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "paged_copy.cuh"

using namespace lmcache_cuda;

static int failures = 0;
#define CHECK(cond, ...)                      \
  do {                                        \
    if (!(cond)) {                            \
      std::printf("FAIL %s:%d: ", __FILE__, __LINE__); \
      std::printf(__VA_ARGS__);               \
      std::printf("\n");                      \
      ++failures;                             \
      return;                                 \
    }                                         \
  } while (0)

struct Case {
  int64_t layers, heads, block_size, num_blocks, head_size, elem_size;
  bool permuted;  // physical [nb, B, H, 2D] instead of [nb, H, B, 2D]
  int64_t block_pad;  // extra elements between blocks
};

template <typename V>
void run_case(const Case& c, const std::vector<int64_t>& slots, std::mt19937& rng) {
  const int64_t es = c.elem_size, D = c.head_size, H = c.heads, B = c.block_size;
  const int64_t row = 2 * D;  // elements
  int64_t sh, st;
  if (c.permuted) { st = H * row; sh = row; } else { sh = B * row; st = row; }
  const int64_t block_numel = H * B * row;
  const int64_t sb = block_numel + c.block_pad;
  const int64_t layer_bytes = c.num_blocks * sb * es;
  const int64_t T = static_cast<int64_t>(slots.size());
  const int64_t vec = sizeof(V);
  if ((D * es) % vec || (sb * es) % vec || (sh * es) % vec || (st * es) % vec) return;

  // uint4 storage keeps every base 16-byte aligned.
  auto alloc = [](int64_t bytes) { return std::vector<uint4>((bytes + 15) / 16 + 1); };
  std::vector<std::vector<uint4>> layers;
  for (int64_t l = 0; l < c.layers; ++l) {
    layers.push_back(alloc(layer_bytes));
    auto* p = reinterpret_cast<uint8_t*>(layers.back().data());
    for (int64_t b = 0; b < layer_bytes; ++b) p[b] = static_cast<uint8_t>(rng());
  }
  const int64_t buf_bytes = c.layers * 2 * T * H * D * es;
  auto buf_store = alloc(buf_bytes);
  auto* buf = reinterpret_cast<uint8_t*>(buf_store.data());
  std::memset(buf, 0xAB, buf_bytes);

  TokenGeom g{T, H, B, c.num_blocks, D * es / vec, sb * es / vec, sh * es / vec, st * es / vec};
  const int64_t work = 2 * H * g.row_vecs;
  for (int64_t l = 0; l < c.layers; ++l)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < work; ++i)
        token_copy_step<V, true>(reinterpret_cast<V*>(layers[l].data()),
                                 reinterpret_cast<V*>(buf), l, t, slots[t], i, g);

  // Naive model: byte b of K/V row (l, kv, t, h).
  for (int64_t l = 0; l < c.layers; ++l) {
    const auto* p = reinterpret_cast<const uint8_t*>(layers[l].data());
    for (int64_t kv = 0; kv < 2; ++kv)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t b = 0; b < D * es; ++b) {
            const int64_t s = slots[t];
            const int64_t dst = (((l * 2 + kv) * T + t) * H + h) * D * es + b;
            uint8_t want = 0;
            if (s >= 0 && s < c.num_blocks * B) {
              const int64_t blk = s / B, off = s % B;
              want = p[(blk * sb + off * st + h * sh + kv * D) * es + b];
            }
            CHECK(buf[dst] == want, "gather vec=%lld l=%lld kv=%lld t=%lld h=%lld b=%lld",
                  (long long)vec, (long long)l, (long long)kv, (long long)t, (long long)h,
                  (long long)b);
          }
  }

  // Scatter into zeroed layers, then every valid slot's rows must match the original.
  std::vector<std::vector<uint4>> back;
  for (int64_t l = 0; l < c.layers; ++l) back.push_back(alloc(layer_bytes));
  for (int64_t l = 0; l < c.layers; ++l)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < work; ++i)
        token_copy_step<V, false>(reinterpret_cast<V*>(back[l].data()),
                                  reinterpret_cast<V*>(buf), l, t, slots[t], i, g);
  for (int64_t l = 0; l < c.layers; ++l) {
    const auto* p = reinterpret_cast<const uint8_t*>(layers[l].data());
    const auto* q = reinterpret_cast<const uint8_t*>(back[l].data());
    for (int64_t t = 0; t < T; ++t) {
      const int64_t s = slots[t];
      if (s < 0 || s >= c.num_blocks * B) continue;
      const int64_t blk = s / B, off = s % B;
      for (int64_t h = 0; h < H; ++h) {
        const int64_t base = (blk * sb + off * st + h * sh) * es;
        CHECK(std::memcmp(p + base, q + base, row * es) == 0, "scatter vec=%lld t=%lld h=%lld",
              (long long)vec, (long long)t, (long long)h);
      }
    }
  }

  // Blocks: gather ids (with an invalid one), compare, scatter back.
  std::vector<int64_t> ids;
  for (int64_t b = c.num_blocks - 1; b >= 0; b -= 2) ids.push_back(b);
  ids.push_back(-1);
  const int64_t N = static_cast<int64_t>(ids.size());
  if ((block_numel * es) % vec) return;
  BlockGeom bg{N, c.num_blocks, block_numel * es / vec, sb * es / vec};
  auto bbuf_store = alloc(c.layers * N * block_numel * es);
  auto* bbuf = reinterpret_cast<uint8_t*>(bbuf_store.data());
  for (int64_t l = 0; l < c.layers; ++l)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i = 0; i < bg.block_vecs; ++i)
        block_copy_step<V, true>(reinterpret_cast<V*>(layers[l].data()),
                                 reinterpret_cast<V*>(bbuf), l, n, ids[n], i, bg);
  for (int64_t l = 0; l < c.layers; ++l) {
    const auto* p = reinterpret_cast<const uint8_t*>(layers[l].data());
    for (int64_t n = 0; n < N; ++n) {
      const uint8_t* got = bbuf + (l * N + n) * block_numel * es;
      if (ids[n] < 0) {
        for (int64_t b = 0; b < block_numel * es; ++b) CHECK(got[b] == 0, "invalid id not zeroed");
      } else {
        CHECK(std::memcmp(got, p + ids[n] * sb * es, block_numel * es) == 0,
              "block gather vec=%lld n=%lld", (long long)vec, (long long)n);
      }
    }
  }
  std::vector<std::vector<uint4>> bback;
  for (int64_t l = 0; l < c.layers; ++l) bback.push_back(alloc(layer_bytes));
  for (int64_t l = 0; l < c.layers; ++l)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i = 0; i < bg.block_vecs; ++i)
        block_copy_step<V, false>(reinterpret_cast<V*>(bback[l].data()),
                                  reinterpret_cast<V*>(bbuf), l, n, ids[n], i, bg);
  for (int64_t l = 0; l < c.layers; ++l)
    for (int64_t n = 0; n < N; ++n) {
      if (ids[n] < 0) continue;
      const int64_t base = ids[n] * sb * es;
      CHECK(std::memcmp(reinterpret_cast<const uint8_t*>(layers[l].data()) + base,
                        reinterpret_cast<const uint8_t*>(bback[l].data()) + base,
                        block_numel * es) == 0,
            "block scatter vec=%lld", (long long)vec);
    }
}

int main() {
  std::mt19937 rng(1234);
  int cases = 0;
  for (int64_t B : {16, 32, 128})
    for (int64_t D : {64, 128, 36})
      for (int64_t es : {1, 2, 4})
        for (bool permuted : {false, true})
          for (int64_t pad : {0, 3}) {
            Case c{3, 2, B, 5, D, es, permuted, pad};
            std::vector<int64_t> slots;
            for (int64_t t = 0; t < 23; ++t) slots.push_back((t * 7 + 3) % (c.num_blocks * B));
            slots.push_back(-1);
            slots.push_back(c.num_blocks * B);  // out of range
            slots.push_back(c.num_blocks * B - 1);
            run_case<uint8_t>(c, slots, rng);
            run_case<uint16_t>(c, slots, rng);
            run_case<uint32_t>(c, slots, rng);
            run_case<uint2>(c, slots, rng);
            run_case<uint4>(c, slots, rng);
            ++cases;
          }
  // Vector width selection.
  {
    int64_t v1[3] = {256, 512, 4096};
    int64_t v2[3] = {72, 512, 4096};
    int64_t v3[2] = {128, 2};
    int64_t v4[1] = {3};
    if (choose_vec_bytes(v1, 3) != 16 || choose_vec_bytes(v2, 3) != 8 ||
        choose_vec_bytes(v3, 2) != 2 || choose_vec_bytes(v4, 1) != 1) {
      std::printf("FAIL choose_vec_bytes\n");
      ++failures;
    }
  }
  std::printf("%d layouts x 5 vector widths, %d failures\n", cases, failures);
  return failures == 0 ? 0 : 1;
}
