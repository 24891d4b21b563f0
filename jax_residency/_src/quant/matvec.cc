// One-row products with quantized matrices on CPU, reading each code once
// (jax_residency/_src/quant/native.py builds this file and registers its handlers
// with XLA; docs/quantization.md, "Reading codes once").
//
// The matrices are stored as rows along their input axis (quant/schemes.py):
//   int8: codes (rows, n) int8, scale (rows, 1);          w[r, i] = c * scale[r]
//   int4: codes (rows / 2, n) uint8, scale and offset (rows, n / g);
//         byte [p, i] holds row p in its low nibble and row p + rows / 2 in its high
//         one;                                             w[r, i] = c * scale + offset
// and y[r] = sum_i x[i] * w[r, i]. The sums are taken on the codes and scaled after
// (`int8_rows`, `int4_rows`): the result differs from XLA's product of the decoded
// matrix by float32 rounding of the sums (tests/test_native_kernels.py).
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kLanes = 16;
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
void int4_rows(const float* x, const float* xsum, const uint8_t* codes, const float* scale,
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
void int8_rows(const float* x, const int8_t* codes, const float* scale, float* y, int64_t n,
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
                      ffi::ResultBuffer<ffi::F32> y) {
  const auto cd = codes.dimensions();
  const auto sd = scale.dimensions();
  if (cd.size() != 2 || sd.size() != 2 || sd[0] != 2 * cd[0] || sd[1] == 0 ||
      cd[1] % sd[1] != 0 || (cd[1] / sd[1]) % kLanes != 0 || x.element_count() != cd[1] ||
      offset.element_count() != scale.element_count() || y->element_count() != sd[0]) {
    return ffi::Error::InvalidArgument("jr_int4_matvec: operand shapes do not agree");
  }
  const int64_t half = cd[0], n = cd[1], g = n / sd[1];
  const float* xp = x.typed_data();
  const uint8_t* cp = codes.typed_data();
  const float* sp = scale.typed_data();
  const float* op = offset.typed_data();
  float* yp = y->typed_data();
  std::vector<float> sums(n / g);
  group_sums(xp, sums.data(), n, g);
  const float* xs = sums.data();
  parallel_chunks(pool, half, 16, [=](int64_t a, int64_t b) {
    int4_rows(xp, xs, cp, sp, op, yp, n, g, half, a, b);
  });
  return ffi::Error::Success();
}

ffi::Error Int8Matvec(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> codes,
                      ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y) {
  const auto cd = codes.dimensions();
  if (cd.size() != 2 || cd[1] % kLanes != 0 || x.element_count() != cd[1] ||
      scale.element_count() != cd[0] || y->element_count() != cd[0]) {
    return ffi::Error::InvalidArgument("jr_int8_matvec: operand shapes do not agree");
  }
  const int64_t rows = cd[0], n = cd[1];
  const float* xp = x.typed_data();
  const int8_t* cp = codes.typed_data();
  const float* sp = scale.typed_data();
  float* yp = y->typed_data();
  parallel_chunks(pool, rows, 32, [=](int64_t a, int64_t b) {
    int8_rows(xp, cp, sp, yp, n, a, b);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JrInt4Matvec, Int4Matvec,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JrInt8Matvec, Int8Matvec,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
