/* The fp8 codec's encode and decode in one pass each (lmcache_core/fp8.py documents
 * the format). Compiled when the package is built, once per instruction set:
 * fp8_generic.c, fp8_avx2.c and fp8_avx512.c each include this file with LMC_NAME
 * giving the exported functions a suffix; fp8_module.c picks the best one this CPU
 * runs (lmcache_core/fp8_native.py loads it).
 *
 * Every arithmetic step is the one the torch path performs, in the same order and
 * in float32 (IEEE, no fused multiply-add, no flush to zero), so both paths write
 * the same frame bytes and decode the same values; tests/core/test_fp8_native.py
 * compares them. Built without -ffast-math on purpose.
 *
 * dtype codes: 0 float16, 1 bfloat16, 2 float32.
 */
#include <stdint.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define GROUP 64

static inline float from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint32_t to_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* bfloat16 <- float32, round to nearest even (inputs here are finite) */
static inline uint16_t bf16_rne(float f) {
    uint32_t u = to_bits(f);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* float8 e4m3fn <- float32, clamped to +-448, round to nearest even. Signed int32
 * arithmetic on the bits (magnitudes are non-negative, and their order is the
 * values' order), so the compiler vectorizes it on any SIMD. */
static inline uint8_t e4m3_rne(float f) {
    int32_t u = (int32_t)to_bits(f);
    int32_t sign = (u >> 24) & 0x80;
    int32_t a = u & 0x7FFFFFFF;
    a = a < 0x43E00000 ? a : 0x43E00000; /* 448.0f */
    /* below 2**-6 (float8's smallest normal): adding 2**14 leaves float32 a spacing
     * of 2**-9 (float8's subnormal step), so the FPU rounds to it */
    int32_t sub = (int32_t)to_bits(from_bits((uint32_t)a) + 16384.0f) - (141 << 23);
    /* normal: rebias the exponent (127 -> 7) and round the mantissa to 3 bits */
    int32_t nor = (a + (int32_t)(((uint32_t)(7 - 127) << 23) + 0x7FFFFu) + ((a >> 20) & 1)) >> 20;
    return (uint8_t)((a < (121 << 23) ? sub : nor) | sign);
}

/* GROUP values of src from index at, as float32 */
static inline void load_group(const void *src, int dtype, int64_t at, float *buf) {
    if (dtype == 0) {
        const uint16_t *s = (const uint16_t *)src + at;
#ifdef __F16C__
        for (int i = 0; i < GROUP; i += 8) _mm256_storeu_ps(buf + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
#else
        for (int i = 0; i < GROUP; i++) buf[i] = (float)*(const _Float16 *)(s + i);
#endif
    } else if (dtype == 1) {
        const uint16_t *s = (const uint16_t *)src + at;
        for (int i = 0; i < GROUP; i++) buf[i] = from_bits((uint32_t)s[i] << 16);
    } else {
        memcpy(buf, (const float *)src + at, GROUP * 4);
    }
}

#ifdef __AVX512F__
/* 16 lanes at a time, the same steps as e4m3_rne: the clamp to +-448 on the
 * magnitude's bits (the same order as the values'), and the subnormal rounding only
 * for vectors that hold a value below 2**-6 */
static inline void quantize_group(const float *restrict buf, float r, uint8_t *restrict codes) {
    const __m512 rv = _mm512_set1_ps(r);
    const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF), max_bits = _mm512_set1_epi32(0x43E00000); /* 448.0f */
    const __m512i rebias = _mm512_set1_epi32((int)(((uint32_t)(7 - 127) << 23) + 0x7FFFFu)), one = _mm512_set1_epi32(1);
    const __m512i min_normal = _mm512_set1_epi32(121 << 23), magic = _mm512_set1_epi32(141 << 23);
    const __m512i sign_bit = _mm512_set1_epi32(0x80);
    for (int i = 0; i < GROUP; i += 16) {
        __m512i u = _mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps(buf + i), rv));
        __m512i a = _mm512_min_epu32(_mm512_and_si512(u, abs_mask), max_bits);
        __m512i sign = _mm512_and_si512(_mm512_srli_epi32(u, 24), sign_bit);
        __m512i code = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(a, rebias), _mm512_and_si512(_mm512_srli_epi32(a, 20), one)), 20);
        __mmask16 small = _mm512_cmplt_epu32_mask(a, min_normal);
        if (small) {
            __m512i sub = _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), _mm512_set1_ps(16384.0f))), magic);
            code = _mm512_mask_mov_epi32(code, small, sub);
        }
        _mm_storeu_si128((__m128i *)(codes + i), _mm512_cvtepi32_epi8(_mm512_or_si512(code, sign)));
    }
}
#else
static inline void quantize_group(const float *restrict buf, float r, uint8_t *restrict codes) {
    for (int i = 0; i < GROUP; i++) codes[i] = e4m3_rne(buf[i] * r);
}
#endif

/* Groups handled together: their maxima, then their scales (one vector division for
 * all), then their codes, so no group waits on its own division */
#define BATCH 16

/* nb groups (at most BATCH) of buf: scales (bfloat16 bits) and codes. Returns -1 for
 * NaN or inf. */
static inline int encode_groups(const float *buf, int nb, float inv_max_up, float min_scale, float limit, uint16_t *scales,
                                uint8_t *codes) {
    uint32_t top[BATCH];
    float r[BATCH];
    for (int g = 0; g < nb; g++) {
        /* the largest magnitude, on the bits: for non-negative floats their order is
         * the values' order, and anything above the largest finite is NaN or inf */
        uint32_t t = 0;
        for (int i = 0; i < GROUP; i++) {
            uint32_t a = to_bits(buf[g * GROUP + i]) & 0x7FFFFFFFu;
            t = a > t ? a : t;
        }
        top[g] = t;
    }
    uint32_t bad = 0;
    for (int g = 0; g < nb; g++) bad |= top[g] > 0x7F7FFFFFu;
    if (bad) return -1;
    for (int g = 0; g < nb; g++) {
        float s = from_bits(top[g]) * inv_max_up;
        s = s < min_scale ? min_scale : s;
        s = s > limit ? limit : s;
        uint16_t sb = bf16_rne(s);
        scales[g] = sb;
        r[g] = 1.0f / from_bits((uint32_t)sb << 16);
    }
    for (int g = 0; g < nb; g++) quantize_group(buf + g * GROUP, r[g], codes + g * GROUP);
    return 0;
}

static inline void put_scales(uint8_t *out, int64_t g0, const uint16_t *scales, int nb) {
    for (int g = 0; g < nb; g++) {
        out[2 * (g0 + g)] = (uint8_t)(scales[g] & 0xFF);
        out[2 * (g0 + g) + 1] = (uint8_t)(scales[g] >> 8);
    }
}

/* Writes 2 * ceil(n / 64) bytes of scales (little-endian bfloat16) then n codes to
 * out. Returns 0, or -1 when a value is NaN or infinite (out is then partly written). */
int LMC_NAME(lmc_fp8_encode)(const void *src, int dtype, int64_t n, float inv_max_up, float min_scale, float limit, uint8_t *out) {
    int64_t groups = (n + GROUP - 1) / GROUP;
    int64_t full = n / GROUP;
    uint8_t *codes = out + 2 * groups;
    float buf[BATCH * GROUP];
    uint16_t scales[BATCH];
    for (int64_t g0 = 0; g0 < full; g0 += BATCH) {
        int nb = full - g0 < BATCH ? (int)(full - g0) : BATCH;
        for (int g = 0; g < nb; g++) load_group(src, dtype, (g0 + g) * GROUP, buf + g * GROUP);
        if (encode_groups(buf, nb, inv_max_up, min_scale, limit, scales, codes + g0 * GROUP)) return -1;
        put_scales(out, g0, scales, nb);
    }
    if (full < groups) { /* the last, short group: zeros after its values change no maximum */
        int64_t at = full * GROUP, len = n - at;
        int esize = dtype == 2 ? 4 : 2;
        uint8_t tail[GROUP * 4] = {0};
        uint8_t tail_codes[GROUP];
        memcpy(tail, (const uint8_t *)src + at * esize, (size_t)(len * esize));
        load_group(tail, dtype, 0, buf);
        if (encode_groups(buf, 1, inv_max_up, min_scale, limit, scales, tail_codes)) return -1;
        memcpy(codes + at, tail_codes, (size_t)len);
        put_scales(out, full, scales, 1);
    }
    return 0;
}

/* group g's scale: little-endian bfloat16 bits at the payload's start */
static inline float scale_at(const uint8_t *payload, int64_t g) {
    return from_bits(((uint32_t)payload[2 * g] | ((uint32_t)payload[2 * g + 1] << 8)) << 16);
}

/* Decodes n values into dst (dtype, contiguous). Returns 0; -1 for a scale that is
 * negative, not finite or over limit; -2 for a float8 NaN code (never written by
 * the encoder). The payload is checked whole before dst is written. */
int LMC_NAME(lmc_fp8_decode)(const uint8_t *payload, int64_t n, int dtype, float limit, void *dst) {
    int64_t groups = (n + GROUP - 1) / GROUP;
    const uint8_t *codes = payload + 2 * groups;
    for (int64_t g = 0; g < groups; g++) {
        float s = scale_at(payload, g);
        if (!(s >= 0.0f && s <= limit)) return -1;
    }
    int nan = 0;
    for (int64_t i = 0; i < n; i++) nan |= (codes[i] & 0x7Fu) == 0x7Fu;
    if (nan) return -2;
    float buf[GROUP];
    for (int64_t g = 0; g < groups; g++) {
        float s = scale_at(payload, g);
        int64_t at = g * GROUP;
        int64_t len = n - at < GROUP ? n - at : GROUP;
        const uint8_t *c = codes + at;
        for (int64_t i = 0; i < len; i++) {
            uint32_t code = c[i];
            /* s.eeee.mmm -> float32 s.0000eeee.mmm0..0: the value times 2**-120,
             * exact (subnormals included); times 2**120 is exact again */
            float v = from_bits(((code & 0x7Fu) << 20) | ((code & 0x80u) << 24)) * 0x1p120f;
            buf[i] = v * s;
        }
        if (dtype == 0) {
            uint16_t *d = (uint16_t *)dst + at;
            int64_t i = 0;
#ifdef __F16C__
            for (; i + 8 <= len; i += 8)
                _mm_storeu_si128((__m128i *)(d + i), _mm256_cvtps_ph(_mm256_loadu_ps(buf + i), _MM_FROUND_TO_NEAREST_INT));
#endif
            for (; i < len; i++) *(_Float16 *)(d + i) = (_Float16)buf[i];
        } else if (dtype == 1) {
            uint16_t *d = (uint16_t *)dst + at;
            for (int64_t i = 0; i < len; i++) d[i] = bf16_rne(buf[i]);
        } else {
            memcpy((float *)dst + at, buf, (size_t)len * 4);
        }
    }
    return 0;
}
