// Products of a few rows (up to kMaxRows) with quantized matrices on CPU, reading each
// code once
// (jax_residency/_src/quant/native.py builds this file and registers its handlers
// with XLA; docs/quantization.md, "Reading codes once").
//
// The matrices are stored as rows along their input axis (quant/schemes.py):
//   int8: codes (rows, n) int8, scale (rows, 1);          w[r, i] = c * scale[r]
//   int4: codes (rows / 2, n) uint8, scale and offset (rows, n / g);
//         byte [p, i] holds row p in its low nibble and row p + rows / 2 in its high
//         one;                                             w[r, i] = c * scale + offset
// and y[r] = sum_i x[i] * w[r, i], for each of x's m rows (y: m rows of the matrix's
// rows): a chunk of the matrix's rows is multiplied by every row of x while it is in
// cache, each row of x exactly as it would be alone. The sums are taken on the codes and scaled after
// (`int8_rows`, `int4_rows`): the result differs from XLA's product of the decoded
// matrix by float32 rounding of the sums (tests/test_native_kernels.py). With the
// handlers' `activations` attribute 1, x is rounded to 8-bit blocks first and the sums
// are integer ones ("Integer products" below).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__) || defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

// The loops over a chunk of rows are compiled once, not inlined into each caller: the
// calling thread and the pool's threads then run the same instructions, so a row's
// result does not depend on which thread computed it (GCC contracts a * b + c into a
// fused multiply-add, or not, per inlined copy).
#define NOINLINE __attribute__((noinline))

constexpr int64_t kLanes = 16;
constexpr int64_t kMaxRows = 16;  // rows of x one call takes (native.py's MAX_ROWS)
typedef float vf __attribute__((vector_size(kLanes * 4)));
typedef int32_t vi __attribute__((vector_size(kLanes * 4)));
typedef uint8_t vu8 __attribute__((vector_size(kLanes)));
typedef int8_t vs8 __attribute__((vector_size(kLanes)));

template <typename V, typename T>
inline V load(const T* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Bytes to floats through 32-bit integers: one widening and one conversion per
// vector (a direct byte-to-float conversion is compiled element by element).
template <typename V>
inline vf widen(V b) {
  return __builtin_convertvector(__builtin_convertvector(b, vi), vf);
}

// 16 signed bytes as floats. GCC compiles the generic form one byte at a time (a
// signed byte vector, unlike the masked nibbles above, is not widened as a vector).
inline vf widen_s8(const int8_t* p) {
#if defined(__AVX512F__)
  return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
#else
  return widen(load<vs8>(p));
#endif
}

inline float lanes_sum(vf v) {
  float s = 0;
  for (int64_t k = 0; k < kLanes; ++k) s += v[k];
  return s;
}

// Each group's sum is taken on the codes as they are, then scaled:
//   sum_i x[i] * (c[i] * scale + offset) = scale * sum_i x[i] * c[i] + offset * xsum
// with xsum the group's sum of x (`group_sums`, once a call, shared by every row). One
// multiply-add a code instead of two: the decode's arithmetic, not the reads, bound
// the loop on the development VM.
NOINLINE void int4_rows(const float* x, const float* xsum, const uint8_t* codes, const float* scale,
               const float* offset, float* y, int64_t n, int64_t g, int64_t half, int64_t p0,
               int64_t p1) {
  const int64_t groups = n / g;
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* c = codes + p * n;
    const float* s_lo = scale + p * groups;
    const float* o_lo = offset + p * groups;
    const float* s_hi = scale + (p + half) * groups;
    const float* o_hi = offset + (p + half) * groups;
    vf lo = {}, hi = {};
    float lo_off = 0, hi_off = 0;
    for (int64_t j = 0; j < groups; ++j) {
      // Codes 2 KiB ahead asked for early: measured 10-25% faster than leaving the
      // streams to the hardware prefetcher on the 2-core development VM.
      __builtin_prefetch(c + j * g + 2048);
      vf dlo = {}, dhi = {};
      for (int64_t i = j * g; i < (j + 1) * g; i += kLanes) {
        const vu8 b = load<vu8>(c + i);
        const vf xv = load<vf>(x + i);
        dlo += xv * widen(vu8(b & 15));
        dhi += xv * widen(vu8(b >> 4));
      }
      lo += dlo * s_lo[j];
      hi += dhi * s_hi[j];
      lo_off += o_lo[j] * xsum[j];
      hi_off += o_hi[j] * xsum[j];
    }
    y[p] = lanes_sum(lo) + lo_off;
    y[p + half] = lanes_sum(hi) + hi_off;
  }
}

// The sum of x over each group of g inputs.
void group_sums(const float* x, float* out, int64_t n, int64_t g) {
  for (int64_t j = 0; j < n / g; ++j) {
    vf acc = {};
    for (int64_t i = j * g; i < (j + 1) * g; i += kLanes) acc += load<vf>(x + i);
    out[j] = lanes_sum(acc);
  }
}

// A row's sum on the codes, scaled once: scale * sum_i x[i] * c[i].
NOINLINE void int8_rows(const float* x, const int8_t* codes, const float* scale, float* y, int64_t n,
               int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const int8_t* c = codes + r * n;
    vf acc = {};
    for (int64_t i = 0; i < n; i += 4 * kLanes) {
      __builtin_prefetch(c + i + 2048);
      for (int64_t k = i; k < i + 4 * kLanes && k < n; k += kLanes) {
        acc += load<vf>(x + k) * widen_s8(c + k);
      }
    }
    y[r] = lanes_sum(acc) * scale[r];
  }
}

// --- GGML rows (quant/ggml.py has the layouts) ------------------------------------
// A row is n / block_size blocks; each type's dot product with x takes the sums on
// the codes as they are and scales them once a block or sub-block, as llama.cpp's own
// CPU dot products do: sum_i x[i] * (s * c[i] - m) = s * sum_i x[i] * c[i] - m * sum_i x[i].

// IEEE half to float, exactly (normal, subnormal, infinite and NaN halves): one
// instruction where the CPU converts halves (F16C), else by the bits.
inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    int e = -1;
    do {
      mant <<= 1;
      ++e;
    } while (!(mant & 0x400));
    bits = sign | uint32_t(112 - e) << 23 | ((mant & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// Type ids (GGUF's), as quant/ggml.py's table gives them.
enum GgmlId : int32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ2_K = 10,
  kQ3_K = 11,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kIQ4_NL = 20,
  kIQ4_XS = 23,
  kBF16 = 30
};

float dot_q8_0(const float* x, const uint8_t* b, int64_t n) {
  vf acc = {};
  for (int64_t i = 0; i < n; i += 32, b += 34) {
    const vf part = load<vf>(x + i) * widen_s8((const int8_t*)b + 2) +
                    load<vf>(x + i + 16) * widen_s8((const int8_t*)b + 18);
    acc += part * half(b);
  }
  return lanes_sum(acc);
}

// Q4_0 (c - 8) * d, Q4_1 c * d + m, Q5_0 (c - 16) * d and Q5_1 c * d + m: a half d (and
// m), for Q5 a little-endian 32-bit word whose bit j is value j's fifth bit, then 16
// code bytes, value j in the low nibble of byte j and j + 16 in the high one.
template <bool kOffset, bool kFifth>
float dot_q_01(const float* x, const uint8_t* b, int64_t n) {
  constexpr int64_t kCodes = (kOffset ? 4 : 2) + (kFifth ? 4 : 0), kBytes = kCodes + 16;
  const vf centre = vf{} + (kFifth ? 16.0f : 8.0f);
  const vi lanes = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  vf acc = {};
  for (int64_t i = 0; i < n; i += 32, b += kBytes) {
    const vu8 q = load<vu8>(b + kCodes);
    vi i0 = __builtin_convertvector(vu8(q & 15), vi), i1 = __builtin_convertvector(vu8(q >> 4), vi);
    if (kFifth) {
      uint32_t qh;
      std::memcpy(&qh, b + kCodes - 4, 4);
      const vi word = vi{} + int32_t(qh);
      i0 |= ((word >> lanes) & 1) << 4;
      i1 |= ((word >> (lanes + 16)) & 1) << 4;
    }
    const vf c0 = __builtin_convertvector(i0, vf), c1 = __builtin_convertvector(i1, vf);
    const vf x0 = load<vf>(x + i), x1 = load<vf>(x + i + 16);
    if (kOffset) {
      acc += (x0 * c0 + x1 * c1) * half(b) + (x0 + x1) * half(b + 2);
    } else {
      acc += (x0 * (c0 - centre) + x1 * (c1 - centre)) * half(b);
    }
  }
  return lanes_sum(acc);
}

// The 6-bit scale and minimum of sub-block k of a Q4_K/Q5_K block (12 packed bytes).
inline void k_scale(const uint8_t* s, int k, float* sc, float* mn) {
  if (k < 4) {
    *sc = float(s[k] & 63);
    *mn = float(s[k + 4] & 63);
  } else {
    *sc = float((s[k + 4] & 0xF) | ((s[k - 4] >> 6) << 4));
    *mn = float((s[k + 4] >> 4) | ((s[k] >> 6) << 4));
  }
}

// Q4_K and Q5_K: (d * sc) * c - dmin * mn over 8 sub-blocks of 32; run r of the code
// bytes holds sub-block 2r in its low nibbles and 2r + 1 in its high ones; Q5_K's top
// bit of value l of sub-block k is bit k of qh[l].
template <bool kFifth>
float dot_q45_k(const float* x, const uint8_t* b, int64_t n) {
  constexpr int64_t kBytes = kFifth ? 176 : 144;
  vf acc = {};
  for (int64_t i = 0; i < n; i += 256, b += kBytes) {
    const float d = half(b), dmin = half(b + 2);
    const uint8_t* qs = b + (kFifth ? 48 : 16);
    const vu8 h0 = kFifth ? load<vu8>(b + 16) : vu8{}, h1 = kFifth ? load<vu8>(b + 32) : vu8{};
    for (int r = 0; r < 4; ++r) {
      const vu8 q0 = load<vu8>(qs + 32 * r), q1 = load<vu8>(qs + 32 * r + 16);
      for (int half_ = 0; half_ < 2; ++half_) {  // sub-block 2r (low nibbles), 2r + 1
        const int k = 2 * r + half_;
        vu8 c0 = half_ ? vu8(q0 >> 4) : vu8(q0 & 15), c1 = half_ ? vu8(q1 >> 4) : vu8(q1 & 15);
        if (kFifth) {
          c0 |= vu8(((h0 >> k) & 1) << 4);
          c1 |= vu8(((h1 >> k) & 1) << 4);
        }
        const float* xs = x + i + 32 * k;
        const vf x0 = load<vf>(xs), x1 = load<vf>(xs + 16);
        float sc, mn;
        k_scale(b + 4, k, &sc, &mn);
        acc += (x0 * widen(c0) + x1 * widen(c1)) * (d * sc) - (x0 + x1) * (dmin * mn);
      }
    }
  }
  return lanes_sum(acc);
}

// Q6_K: (d * sc) * (c - 32), a signed byte scale a 16 values; value 32k + l of a
// half-block takes the low (k < 2) or high nibble of ql[l + 32 (k % 2)] and bits 2k,
// 2k + 1 of qh[l].
float dot_q6_k(const float* x, const uint8_t* b, int64_t n) {
  const vf off = vf{} + 32.0f;
  vf acc = {};
  for (int64_t i = 0; i < n; i += 256, b += 210) {
    const float d = half(b + 208);
    const int8_t* sc = (const int8_t*)(b + 192);
    for (int h = 0; h < 2; ++h) {
      for (int k = 0; k < 4; ++k) {
        for (int l0 = 0; l0 < 32; l0 += 16) {
          const vu8 ql = load<vu8>(b + 64 * h + l0 + 32 * (k % 2));
          const vu8 qh = load<vu8>(b + 128 + 32 * h + l0);
          const vu8 c = vu8((ql >> (4 * (k / 2))) & 15) | vu8(((qh >> (2 * k)) & 3) << 4);
          const vf xv = load<vf>(x + i + 128 * h + 32 * k + l0);
          acc += xv * (widen(c) - off) * (d * float(sc[8 * h + 2 * k + l0 / 16]));
        }
      }
    }
  }
  return lanes_sum(acc);
}

// Q2_K: (d * sc) * c - dmin * mn, a 4-bit scale and minimum a 16 values (one byte);
// value 128 h + 32 j + l is bits 2j, 2j + 1 of code byte 32 h + l.
float dot_q2_k(const float* x, const uint8_t* b, int64_t n) {
  vf acc = {};
  for (int64_t i = 0; i < n; i += 256, b += 84) {
    const float d = half(b + 80), dmin = half(b + 82);
    for (int h = 0; h < 2; ++h) {
      for (int l0 = 0; l0 < 32; l0 += 16) {
        const vu8 q = load<vu8>(b + 16 + 32 * h + l0);
        for (int j = 0; j < 4; ++j) {
          const uint8_t s = b[8 * h + 2 * j + l0 / 16];
          const vf xv = load<vf>(x + i + 128 * h + 32 * j + l0);
          acc += xv * (widen(vu8((q >> (2 * j)) & 3)) * (d * float(s & 15)) - dmin * float(s >> 4));
        }
      }
    }
  }
  return lanes_sum(acc);
}

// Q3_K: (d * (sc - 32)) * c, c = the two code bits, less 4 where bit 4h + j of
// hmask[l] is clear; 16 six-bit scales packed in 12 bytes (quant/ggml.py).
float dot_q3_k(const float* x, const uint8_t* b, int64_t n) {
  const vf four = vf{} + 4.0f;
  vf acc = {};
  for (int64_t i = 0; i < n; i += 256, b += 110) {
    const float d = half(b + 108);
    const uint8_t* s = b + 96;
    float dl[16];
    for (int k = 0; k < 16; ++k) {
      const int low = k < 8 ? (s[k] & 15) : (s[k - 8] >> 4);
      const int high = (s[8 + k % 4] >> (2 * (k / 4))) & 3;
      dl[k] = d * float((low | (high << 4)) - 32);
    }
    for (int h = 0; h < 2; ++h) {
      for (int l0 = 0; l0 < 32; l0 += 16) {
        const vu8 q = load<vu8>(b + 32 + 32 * h + l0), hm = load<vu8>(b + l0);
        for (int j = 0; j < 4; ++j) {
          const vu8 c = vu8((q >> (2 * j)) & 3) | vu8(((hm >> (4 * h + j)) & 1) << 2);
          const vf xv = load<vf>(x + i + 128 * h + 32 * j + l0);
          acc += xv * (widen(c) - four) * dl[8 * h + 2 * j + l0 / 16];
        }
      }
    }
  }
  return lanes_sum(acc);
}

// IQ4_NL's and IQ4_XS's 16 levels, picked by 4-bit codes: one permute of a vector of
// them with AVX-512, else lane by lane (which compilers turn into a gather or loads).
inline vf iq4_levels(vu8 codes) {
  alignas(64) static const float kLevels[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                1,    13,   25,  38,  53,  69,  89,  113};
#if defined(__AVX512F__)
  __m128i c;
  std::memcpy(&c, &codes, sizeof c);
  return (vf)_mm512_permutexvar_ps(_mm512_cvtepu8_epi32(c), _mm512_load_ps(kLevels));
#else
  vf out;
  for (int64_t k = 0; k < kLanes; ++k) out[k] = kLevels[codes[k]];
  return out;
#endif
}

float dot_iq4_nl(const float* x, const uint8_t* b, int64_t n) {
  vf acc = {};
  for (int64_t i = 0; i < n; i += 32, b += 18) {
    const vu8 q = load<vu8>(b + 2);
    const vf part = load<vf>(x + i) * iq4_levels(vu8(q & 15)) +
                    load<vf>(x + i + 16) * iq4_levels(vu8(q >> 4));
    acc += part * half(b);
  }
  return lanes_sum(acc);
}

// IQ4_XS: (d * (ls - 32)) * K[c] over 8 sub-blocks of 32; sub-block k's values are the
// low, then the high nibbles of code bytes 16k..16k+15.
float dot_iq4_xs(const float* x, const uint8_t* b, int64_t n) {
  vf acc = {};
  for (int64_t i = 0; i < n; i += 256, b += 136) {
    const float d = half(b);
    const int sh = b[2] | (b[3] << 8);
    for (int k = 0; k < 8; ++k) {
      const int ls = ((b[4 + k / 2] >> (4 * (k % 2))) & 15) | (((sh >> (2 * k)) & 3) << 4);
      const vu8 q = load<vu8>(b + 8 + 16 * k);
      const vf part = load<vf>(x + i + 32 * k) * iq4_levels(vu8(q & 15)) +
                      load<vf>(x + i + 32 * k + 16) * iq4_levels(vu8(q >> 4));
      acc += part * (d * float(ls - 32));
    }
  }
  return lanes_sum(acc);
}

typedef uint16_t vu16 __attribute__((vector_size(kLanes * 2)));
typedef uint32_t vu32 __attribute__((vector_size(kLanes * 4)));

// F32, F16 and BF16 rows, 16 values at a time.
float dot_f32(const float* x, const uint8_t* b, int64_t n) {
  vf acc = {};
  for (int64_t i = 0; i < n; i += kLanes) acc += load<vf>(x + i) * load<vf>(b + 4 * i);
  return lanes_sum(acc);
}

float dot_f16(const float* x, const uint8_t* b, int64_t n) {
  vf acc = {};
  for (int64_t i = 0; i < n; i += kLanes) {
#if defined(__AVX512F__)
    const vf w = (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(b + 2 * i)));
#else
    vf w;
    for (int64_t k = 0; k < kLanes; ++k) w[k] = half(b + 2 * (i + k));
#endif
    acc += load<vf>(x + i) * w;
  }
  return lanes_sum(acc);
}

float dot_bf16(const float* x, const uint8_t* b, int64_t n) {
  vf acc = {};
  for (int64_t i = 0; i < n; i += kLanes) {
    const vu32 bits = __builtin_convertvector(load<vu16>(b + 2 * i), vu32) << 16;
    vf w;
    std::memcpy(&w, &bits, sizeof w);
    acc += load<vf>(x + i) * w;
  }
  return lanes_sum(acc);
}

typedef float (*RowDot)(const float*, const uint8_t*, int64_t);

struct RowType {
  RowDot dot;
  int64_t block_size, block_bytes;
};

// A type id's dot product and block; a null `dot` for a type without one.
RowType row_type(int32_t id) {
  switch (id) {
    case kF32: return {dot_f32, kLanes, 4 * kLanes};  // a "block": one vector's values
    case kF16: return {dot_f16, kLanes, 2 * kLanes};
    case kBF16: return {dot_bf16, kLanes, 2 * kLanes};
    case kQ5_0: return {dot_q_01<false, true>, 32, 22};
    case kQ5_1: return {dot_q_01<true, true>, 32, 24};
    case kIQ4_NL: return {dot_iq4_nl, 32, 18};
    case kIQ4_XS: return {dot_iq4_xs, 256, 136};
    case kQ8_0: return {dot_q8_0, 32, 34};
    case kQ4_0: return {dot_q_01<false, false>, 32, 18};
    case kQ4_1: return {dot_q_01<true, false>, 32, 20};
    case kQ2_K: return {dot_q2_k, 256, 84};
    case kQ3_K: return {dot_q3_k, 256, 110};
    case kQ4_K: return {dot_q45_k<false>, 256, 144};
    case kQ5_K: return {dot_q45_k<true>, 256, 176};
    case kQ6_K: return {dot_q6_k, 256, 210};
    default: return {nullptr, 1, 0};
  }
}

// --- Integer products (activations = 1) --------------------------------------------
// The row x is first rounded to 8-bit blocks of 32, as llama.cpp's CPU products round
// theirs: x[i] ~ dx[b] * q[i], dx[b] = max |x[i]| over block b / 127. A weight block is
// unpacked to 32 small integers and its product with q taken on integers (AVX-512 VNNI
// or AVX-VNNI `dpbusd`, else AVX2 `maddubs`), converted and scaled once a block or
// sub-block. Offsets and minima (Q4_1, Q5_1, the K types', int4's) multiply sums of the
// rounded x, as llama.cpp's Q8_1 and Q8_K blocks carry them: the result is then the
// product of the rounded row, w . xr, whose error w . (x - xr) takes the weights centred
// by their offsets. (The exact sums of x would leave d * c . (x - xr), codes 0..15 not
// centred: on SmolLM2's activations that doubled the logits' error.)

constexpr int64_t kQ = 32;  // values a rounded block of x holds
typedef int8_t s8x32 __attribute__((vector_size(32)));
typedef uint8_t u8x32 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef float f32x8 __attribute__((vector_size(32)));

// x rounded: codes q (n), a scale a block of 32 (d) and the rounded values' sums a 16
// values (s16: d times the integer sum of q).
struct XRow {
  const int8_t* q;
  const float* d;
  const float* s16;
  const float* x;  // the row itself, for the float types' products
};

void round_row(const float* x, int64_t n, int8_t* q, float* d, float* s16) {
  for (int64_t b = 0; b < n / kQ; ++b) {
    const float* xb = x + kQ * b;
    float amax = 0;
    for (int64_t i = 0; i < kQ; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float scale = amax / 127.0f, inv = amax > 0 ? 127.0f / amax : 0.0f;
    d[b] = scale;
    for (int64_t i = 0; i < kQ; ++i) {
      const float v = std::nearbyint(xb[i] * inv);
      q[kQ * b + i] = int8_t(std::min(127.0f, std::max(-127.0f, v)));
    }
  }
  for (int64_t k = 0; k < n / 16; ++k) {
    int32_t s = 0;
    for (int64_t i = 16 * k; i < 16 * k + 16; ++i) s += q[i];
    s16[k] = d[k / 2] * float(s);
  }
}

// Lane k of the result is sum_{j<4} u[4k + j] * s[4k + j] (lanes 0-3: values 0-15):
// u unsigned and at most 128, s signed and at most 127 in size.
inline i32x8 dot_us(u8x32 u, s8x32 s) {
#if defined(__AVX2__)
  const __m256i a = (__m256i)u, b = (__m256i)s;
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return (i32x8)_mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b);
#elif defined(__AVXVNNI__)
  return (i32x8)_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), a, b);
#else
  return (i32x8)_mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
#endif
#else
  i32x8 out = {};
  for (int k = 0; k < 32; ++k) out[k / 4] += int32_t(u[k]) * int32_t(s[k]);
  return out;
#endif
}

// The same for signed w: |w| times s with w's sign.
inline i32x8 dot_ss(s8x32 w, s8x32 s) {
#if defined(__AVX2__)
  const __m256i a = (__m256i)w;
  return dot_us((u8x32)_mm256_sign_epi8(a, a), (s8x32)_mm256_sign_epi8((__m256i)s, a));
#else
  i32x8 out = {};
  for (int k = 0; k < 32; ++k) out[k / 4] += int32_t(w[k]) * int32_t(s[k]);
  return out;
#endif
}

inline f32x8 as_float(i32x8 v) { return __builtin_convertvector(v, f32x8); }

inline float sum8(f32x8 v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

// Two 16-byte halves as one 32-byte vector.
inline u8x32 join(vu8 lo, vu8 hi) {
  return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,
                                 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31);
}

// The lanes' scales of a 32-value block with one scale a 16 values: a for lanes 0-3.
// (Built from two broadcasts: GCC builds the initializer list through the stack, and the
// vector's load then waits on four stores.)
inline f32x8 two_scales(float a, float b) {
#if defined(__AVX__)
  return (f32x8)_mm256_insertf128_ps(_mm256_castps128_ps256(_mm_set1_ps(a)), _mm_set1_ps(b), 1);
#else
  return f32x8{a, a, a, a, b, b, b, b};
#endif
}

// Bit j of a 32-bit word as byte j (0 or `one`).
inline u8x32 bits_as_bytes(uint32_t word, uint8_t one) {
  typedef uint8_t u8x4 __attribute__((vector_size(4)));
  u8x4 w;
  std::memcpy(&w, &word, 4);
  const u8x32 bytes = __builtin_shufflevector(w, w, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1,
                                              1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const u8x32 sel = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128,
                     1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
  return u8x32((bytes & sel) != 0) & one;
}

float idot_q8_0(const XRow& x, const uint8_t* b, int64_t n) {
  f32x8 acc = {};
  for (int64_t i = 0; i < n; i += 32, b += 34) {
    acc += as_float(dot_ss(load<s8x32>(b + 2), load<s8x32>(x.q + i))) * (half(b) * x.d[i / 32]);
  }
  return sum8(acc);
}

// Q4_0 and Q5_0 as signed codes (c - 8, c - 16); Q4_1 and Q5_1 as codes c with the
// minimum m times the sum of the block's rounded x.
template <bool kOffset, bool kFifth>
float idot_q_01(const XRow& x, const uint8_t* b, int64_t n) {
  constexpr int64_t kCodes = (kOffset ? 4 : 2) + (kFifth ? 4 : 0), kBytes = kCodes + 16;
  f32x8 acc = {};
  float off = 0;
  for (int64_t i = 0; i < n; i += 32, b += kBytes) {
    const vu8 q = load<vu8>(b + kCodes);
    u8x32 c = join(vu8(q & 15), vu8(q >> 4));
    if (kFifth) {
      uint32_t qh;
      std::memcpy(&qh, b + kCodes - 4, 4);
      c |= bits_as_bytes(qh, 16);
    }
    const s8x32 xq = load<s8x32>(x.q + i);
    const float dd = half(b) * x.d[i / 32];
    if (kOffset) {
      acc += as_float(dot_us(c, xq)) * dd;
      off += half(b + 2) * (x.s16[i / 16] + x.s16[i / 16 + 1]);
    } else {
      acc += as_float(dot_ss(s8x32(c) - int8_t(kFifth ? 16 : 8), xq)) * dd;
    }
  }
  return sum8(acc) + off;
}

// Q4_K and Q5_K: sub-block k (32 values) is a 32-byte run's low or high nibbles.
template <bool kFifth>
float idot_q45_k(const XRow& x, const uint8_t* b, int64_t n) {
  constexpr int64_t kBytes = kFifth ? 176 : 144;
  f32x8 acc = {};
  float off = 0;
  for (int64_t i = 0; i < n; i += 256, b += kBytes) {
    const float d = half(b), dmin = half(b + 2);
    const uint8_t* qs = b + (kFifth ? 48 : 16);
    const u8x32 qh = kFifth ? load<u8x32>(b + 16) : u8x32{};
    for (int r = 0; r < 4; ++r) {
      const u8x32 q = load<u8x32>(qs + 32 * r);
      for (int hi = 0; hi < 2; ++hi) {
        const int k = 2 * r + hi;
        u8x32 c = hi ? u8x32(q >> 4) : u8x32(q & 15);
        if (kFifth) c |= u8x32(((qh >> k) & 1) << 4);
        float sc, mn;
        k_scale(b + 4, k, &sc, &mn);
        const int64_t at = i + 32 * k;
        acc += as_float(dot_us(c, load<s8x32>(x.q + at))) * (d * sc * x.d[at / 32]);
        off += dmin * mn * (x.s16[at / 16] + x.s16[at / 16 + 1]);
      }
    }
  }
  return sum8(acc) - off;
}

// Q6_K: (d * sc) * (c - 32), a scale a 16 values.
float idot_q6_k(const XRow& x, const uint8_t* b, int64_t n) {
  f32x8 acc = {};
  for (int64_t i = 0; i < n; i += 256, b += 210) {
    const float d = half(b + 208);
    const int8_t* sc = (const int8_t*)(b + 192);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const u8x32 qh = load<u8x32>(b + 128 + 32 * h);
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) {  // unrolled: a byte vector's shift by a constant
        const u8x32 ql = load<u8x32>(b + 64 * h + 32 * (k % 2));
        const u8x32 c = u8x32((ql >> (4 * (k / 2))) & 15) | u8x32(((qh >> (2 * k)) & 3) << 4);
        const int64_t at = i + 128 * h + 32 * k;
        const int s = 8 * h + 2 * k;
        const f32x8 scale = two_scales(float(sc[s]), float(sc[s + 1])) * (d * x.d[at / 32]);
        acc += as_float(dot_ss(s8x32(c) - int8_t(32), load<s8x32>(x.q + at))) * scale;
      }
    }
  }
  return sum8(acc);
}

// Q2_K: (d * sc) * c - dmin * mn, a scale and minimum a 16 values.
float idot_q2_k(const XRow& x, const uint8_t* b, int64_t n) {
  f32x8 acc = {};
  float off = 0;
  for (int64_t i = 0; i < n; i += 256, b += 84) {
    const float d = half(b + 80), dmin = half(b + 82);
    for (int h = 0; h < 2; ++h) {
      const u8x32 q = load<u8x32>(b + 16 + 32 * h);
      for (int j = 0; j < 4; ++j) {
        const uint8_t s0 = b[8 * h + 2 * j], s1 = b[8 * h + 2 * j + 1];
        const int64_t at = i + 128 * h + 32 * j;
        const f32x8 scale = two_scales(float(s0 & 15), float(s1 & 15)) * (d * x.d[at / 32]);
        acc += as_float(dot_us(u8x32((q >> (2 * j)) & 3), load<s8x32>(x.q + at))) * scale;
        off += dmin * (float(s0 >> 4) * x.s16[at / 16] + float(s1 >> 4) * x.s16[at / 16 + 1]);
      }
    }
  }
  return sum8(acc) - off;
}

// Q3_K: (d * (sc - 32)) * c, c = the two code bits, less 4 where the hmask bit is clear.
float idot_q3_k(const XRow& x, const uint8_t* b, int64_t n) {
  f32x8 acc = {};
  for (int64_t i = 0; i < n; i += 256, b += 110) {
    const float d = half(b + 108);
    const uint8_t* s = b + 96;
    float dl[16];
    for (int k = 0; k < 16; ++k) {
      const int low = k < 8 ? (s[k] & 15) : (s[k - 8] >> 4);
      const int high = (s[8 + k % 4] >> (2 * (k / 4))) & 3;
      dl[k] = float((low | (high << 4)) - 32);
    }
    const u8x32 hm = load<u8x32>(b);
    for (int h = 0; h < 2; ++h) {
      const u8x32 q = load<u8x32>(b + 32 + 32 * h);
      for (int j = 0; j < 4; ++j) {
        const u8x32 c = u8x32((q >> (2 * j)) & 3) | u8x32(((hm >> (4 * h + j)) & 1) << 2);
        const int64_t at = i + 128 * h + 32 * j;
        const int k = 8 * h + 2 * j;
        const f32x8 scale = two_scales(dl[k], dl[k + 1]) * (d * x.d[at / 32]);
        acc += as_float(dot_ss(s8x32(c) - int8_t(4), load<s8x32>(x.q + at))) * scale;
      }
    }
  }
  return sum8(acc);
}

// IQ4_NL's and IQ4_XS's levels as signed bytes, picked by 4-bit codes (a byte shuffle
// in each 16-byte half with AVX2).
inline s8x32 iq4_bytes(u8x32 codes) {
  static const int8_t kLevels[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                     1,    13,   25,  38,  53,  69,  89,  113};
#if defined(__AVX2__)
  const __m128i t = _mm_loadu_si128((const __m128i*)kLevels);
  return (s8x32)_mm256_shuffle_epi8(_mm256_set_m128i(t, t), (__m256i)codes);
#else
  s8x32 out;
  for (int k = 0; k < 32; ++k) out[k] = kLevels[codes[k]];
  return out;
#endif
}

float idot_iq4_nl(const XRow& x, const uint8_t* b, int64_t n) {
  f32x8 acc = {};
  for (int64_t i = 0; i < n; i += 32, b += 18) {
    const vu8 q = load<vu8>(b + 2);
    const s8x32 w = iq4_bytes(join(vu8(q & 15), vu8(q >> 4)));
    acc += as_float(dot_ss(w, load<s8x32>(x.q + i))) * (half(b) * x.d[i / 32]);
  }
  return sum8(acc);
}

float idot_iq4_xs(const XRow& x, const uint8_t* b, int64_t n) {
  f32x8 acc = {};
  for (int64_t i = 0; i < n; i += 256, b += 136) {
    const float d = half(b);
    const int sh = b[2] | (b[3] << 8);
    for (int k = 0; k < 8; ++k) {
      const int ls = ((b[4 + k / 2] >> (4 * (k % 2))) & 15) | (((sh >> (2 * k)) & 3) << 4);
      const vu8 q = load<vu8>(b + 8 + 16 * k);
      const s8x32 w = iq4_bytes(join(vu8(q & 15), vu8(q >> 4)));
      const int64_t at = i + 32 * k;
      acc += as_float(dot_ss(w, load<s8x32>(x.q + at))) * (d * float(ls - 32) * x.d[at / 32]);
    }
  }
  return sum8(acc);
}

// The float types keep their float products (nothing to multiply as integers).
float idot_f32(const XRow& x, const uint8_t* b, int64_t n) { return dot_f32(x.x, b, n); }
float idot_f16(const XRow& x, const uint8_t* b, int64_t n) { return dot_f16(x.x, b, n); }
float idot_bf16(const XRow& x, const uint8_t* b, int64_t n) { return dot_bf16(x.x, b, n); }

typedef float (*RowIDot)(const XRow&, const uint8_t*, int64_t);

RowIDot row_idot(int32_t id) {
  switch (id) {
    case kF32: return idot_f32;
    case kF16: return idot_f16;
    case kBF16: return idot_bf16;
    case kQ5_0: return idot_q_01<false, true>;
    case kQ5_1: return idot_q_01<true, true>;
    case kIQ4_NL: return idot_iq4_nl;
    case kIQ4_XS: return idot_iq4_xs;
    case kQ8_0: return idot_q8_0;
    case kQ4_0: return idot_q_01<false, false>;
    case kQ4_1: return idot_q_01<true, false>;
    case kQ2_K: return idot_q2_k;
    case kQ3_K: return idot_q3_k;
    case kQ4_K: return idot_q45_k<false>;
    case kQ5_K: return idot_q45_k<true>;
    case kQ6_K: return idot_q6_k;
    default: return nullptr;
  }
}

// int8 rows: scale[r] * sum_b dx[b] * (codes . q over block b).
NOINLINE void int8_rows_q(const XRow& x, const int8_t* codes, const float* scale, float* y, int64_t n,
                 int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const int8_t* c = codes + r * n;
    f32x8 acc = {};
    for (int64_t i = 0; i < n; i += 32) {
      __builtin_prefetch(c + i + 2048);
      acc += as_float(dot_ss(load<s8x32>(c + i), load<s8x32>(x.q + i))) * x.d[i / 32];
    }
    y[r] = sum8(acc) * scale[r];
  }
}

// int4 rows (both nibbles of a byte row): each group's sum on the codes, scaled, plus
// its offset times the sum of the group's rounded x.
NOINLINE void int4_rows_q(const XRow& x, const uint8_t* codes, const float* scale, const float* offset,
                 float* y, int64_t n, int64_t g, int64_t half_rows, int64_t p0, int64_t p1) {
  const int64_t groups = n / g;
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* c = codes + p * n;
    const float* s_lo = scale + p * groups;
    const float* o_lo = offset + p * groups;
    const float* s_hi = scale + (p + half_rows) * groups;
    const float* o_hi = offset + (p + half_rows) * groups;
    f32x8 lo = {}, hi = {};
    float lo_off = 0, hi_off = 0;
    for (int64_t j = 0; j < groups; ++j) {
      f32x8 glo = {}, ghi = {};
      float xsum = 0;
      for (int64_t i = j * g; i < (j + 1) * g; i += 32) {
        __builtin_prefetch(c + i + 2048);
        const u8x32 b = load<u8x32>(c + i);
        const s8x32 xq = load<s8x32>(x.q + i);
        const float dx = x.d[i / 32];
        glo += as_float(dot_us(u8x32(b & 15), xq)) * dx;
        ghi += as_float(dot_us(u8x32(b >> 4), xq)) * dx;
        xsum += x.s16[i / 16] + x.s16[i / 16 + 1];
      }
      lo += glo * s_lo[j];
      hi += ghi * s_hi[j];
      lo_off += o_lo[j] * xsum;
      hi_off += o_hi[j] * xsum;
    }
    y[p] = sum8(lo) + lo_off;
    y[p + half_rows] = sum8(hi) + hi_off;
  }
}

// x rounded, in buffers the call owns.
struct RoundedRow {
  std::vector<int8_t> q;
  std::vector<float> d, s16;
  XRow row;
  RoundedRow(const float* x, int64_t n) : q(n), d(n / kQ), s16(n / 16) {
    round_row(x, n, q.data(), d.data(), s16.data());
    row = XRow{q.data(), d.data(), s16.data(), x};
  }
};

// The rows of x (m rows of n), each rounded, in buffers the call owns.
struct RoundedRows {
  std::vector<RoundedRow> rows;
  std::vector<XRow> view;
  RoundedRows(const float* x, int64_t m, int64_t n) {
    rows.reserve(m);
    for (int64_t i = 0; i < m; ++i) {
      rows.emplace_back(x + i * n, n);
      view.push_back(rows.back().row);
    }
  }
};

// The rows of x: its element count over the row length n (0 where it does not divide).
inline int64_t x_rows(int64_t count, int64_t n) {
  return n > 0 && count % n == 0 && count / n >= 1 && count / n <= kMaxRows ? count / n : 0;
}

// Runs body(start, stop) over [0, total) in chunks, on the calling thread and on
// XLA's intra-op threads. Helpers take chunks from a shared counter; the caller
// waits only for chunks some thread has taken, so a helper that starts late (its
// pool busy) finds nothing left and returns: no wait depends on the pool.
template <typename F>
void parallel_chunks(ffi::ThreadPool& pool, int64_t total, int64_t chunk, F body) {
  const int64_t chunks = (total + chunk - 1) / chunk;
  struct Shared {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto shared = std::make_shared<Shared>();
  auto work = [shared, chunks, chunk, total, body]() {
    for (;;) {
      const int64_t k = shared->next.fetch_add(1, std::memory_order_relaxed);
      if (k >= chunks) return;
      const int64_t a = k * chunk;
      body(a, a + chunk < total ? a + chunk : total);
      shared->done.fetch_add(1, std::memory_order_release);
    }
  };
  int64_t helpers = pool.num_threads();
  if (helpers > chunks - 1) helpers = chunks - 1;
  for (int64_t t = 0; t < helpers; ++t) {
    auto copy = work;
    pool.Schedule(std::move(copy));
  }
  work();
  while (shared->done.load(std::memory_order_acquire) < chunks) std::this_thread::yield();
}

ffi::Error Int4Matvec(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> codes,
                      ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> offset,
                      ffi::ResultBuffer<ffi::F32> y, int32_t activations) {
  const auto cd = codes.dimensions();
  const auto sd = scale.dimensions();
  const int64_t m = cd.size() == 2 ? x_rows(x.element_count(), cd[1]) : 0;
  if (cd.size() != 2 || sd.size() != 2 || sd[0] != 2 * cd[0] || sd[1] == 0 ||
      cd[1] % sd[1] != 0 || (cd[1] / sd[1]) % kLanes != 0 || m == 0 ||
      offset.element_count() != scale.element_count() || y->element_count() != m * sd[0]) {
    return ffi::Error::InvalidArgument("jr_int4_matvec: operand shapes do not agree");
  }
  const int64_t half = cd[0], n = cd[1], g = n / sd[1], out = sd[0];
  const float* xp = x.typed_data();
  const uint8_t* cp = codes.typed_data();
  const float* sp = scale.typed_data();
  const float* op = offset.typed_data();
  float* yp = y->typed_data();
  // each chunk of rows is read once for all m rows of x (it stays in L1 between them)
  if (activations != 0) {
    if (g % kQ != 0) return ffi::Error::InvalidArgument("jr_int4_matvec: groups of 32 rounded");
    const RoundedRows xq(xp, m, n);
    const XRow* rows = xq.view.data();
    parallel_chunks(pool, half, 16, [=](int64_t a, int64_t b) {
      for (int64_t i = 0; i < m; ++i) int4_rows_q(rows[i], cp, sp, op, yp + i * out, n, g, half, a, b);
    });
    return ffi::Error::Success();
  }
  std::vector<float> sums(m * (n / g));
  for (int64_t i = 0; i < m; ++i) group_sums(xp + i * n, sums.data() + i * (n / g), n, g);
  const float* xs = sums.data();
  parallel_chunks(pool, half, 16, [=](int64_t a, int64_t b) {
    for (int64_t i = 0; i < m; ++i) {
      int4_rows(xp + i * n, xs + i * (n / g), cp, sp, op, yp + i * out, n, g, half, a, b);
    }
  });
  return ffi::Error::Success();
}

ffi::Error Int8Matvec(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> codes,
                      ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y,
                      int32_t activations) {
  const auto cd = codes.dimensions();
  const int64_t m = cd.size() == 2 ? x_rows(x.element_count(), cd[1]) : 0;
  if (cd.size() != 2 || cd[1] % kLanes != 0 || m == 0 || scale.element_count() != cd[0] ||
      y->element_count() != m * cd[0]) {
    return ffi::Error::InvalidArgument("jr_int8_matvec: operand shapes do not agree");
  }
  const int64_t rows = cd[0], n = cd[1];
  const float* xp = x.typed_data();
  const int8_t* cp = codes.typed_data();
  const float* sp = scale.typed_data();
  float* yp = y->typed_data();
  if (activations != 0) {
    if (n % kQ != 0) return ffi::Error::InvalidArgument("jr_int8_matvec: rows of 32 rounded");
    const RoundedRows xq(xp, m, n);
    const XRow* xr = xq.view.data();
    parallel_chunks(pool, rows, 32, [=](int64_t a, int64_t b) {
      for (int64_t i = 0; i < m; ++i) int8_rows_q(xr[i], cp, sp, yp + i * rows, n, a, b);
    });
    return ffi::Error::Success();
  }
  parallel_chunks(pool, rows, 32, [=](int64_t a, int64_t b) {
    for (int64_t i = 0; i < m; ++i) int8_rows(xp + i * n, cp, sp, yp + i * rows, n, a, b);
  });
  return ffi::Error::Success();
}

// y[r] = x . row r, each row of GGML blocks of `types` (GGUF type ids). With one type,
// every row is that type's; with several (a mixed stack, quant/ggml_mixed.py), a row's
// last byte is the index of its type in `types`.
ffi::Error GgmlMatvec(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> blocks,
                      ffi::ResultBuffer<ffi::F32> y, ffi::Span<const int32_t> types,
                      int32_t activations) {
  const auto bd = blocks.dimensions();
  const auto xd = x.dimensions();
  const int64_t n = xd.size() ? xd[xd.size() - 1] : 0, count = int64_t(types.size());
  const int64_t m = x_rows(x.element_count(), n);
  if (bd.size() != 2 || m == 0 || int64_t(y->element_count()) != m * bd[0] || count == 0 ||
      count > 8) {
    return ffi::Error::InvalidArgument("jr_ggml_matvec: operand shapes do not agree");
  }
  const int64_t rows = bd[0], width = bd[1];
  RowDot dots[8];
  for (int64_t t = 0; t < count; ++t) {  // every type's row of n values fits in a row
    const RowType rt = row_type(types[t]);
    if (rt.dot == nullptr || n % rt.block_size != 0 ||
        n / rt.block_size * rt.block_bytes > width - (count > 1)) {
      return ffi::Error::InvalidArgument("jr_ggml_matvec: a type or row length it does not take");
    }
    dots[t] = rt.dot;
  }
  const float* xp = x.typed_data();
  const uint8_t* bp = blocks.typed_data();
  float* yp = y->typed_data();
  if (activations != 0) {
    if (n % kQ != 0) return ffi::Error::InvalidArgument("jr_ggml_matvec: rows of 32 rounded");
    RowIDot idots[8];
    for (int64_t t = 0; t < count; ++t) idots[t] = row_idot(types[t]);
    const RoundedRows xq(xp, m, n);
    const XRow* xr = xq.view.data();
    parallel_chunks(pool, rows, 16, [=](int64_t a, int64_t b) {
      for (int64_t r = a; r < b; ++r) {
        const uint8_t* w = bp + r * width;
        const int64_t t = count == 1 ? 0 : w[width - 1];
        for (int64_t i = 0; i < m; ++i) {
          yp[i * rows + r] = t < count ? idots[t](xr[i], w, n) : __builtin_nanf("");
        }
      }
    });
    return ffi::Error::Success();
  }
  parallel_chunks(pool, rows, 16, [=](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) {
      const uint8_t* row = bp + r * width;
      const int64_t t = count == 1 ? 0 : row[width - 1];
      for (int64_t i = 0; i < m; ++i) {
        yp[i * rows + r] = t < count ? dots[t](xp + i * n, row, n) : __builtin_nanf("");
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JrGgmlMatvec, GgmlMatvec,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<ffi::Span<const int32_t>>("types")
                                  .Attr<int32_t>("activations"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JrInt4Matvec, Int4Matvec,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("activations"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JrInt8Matvec, Int8Matvec,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("activations"));
