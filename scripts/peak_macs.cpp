// Peak multiply-add rate of the instructions selfspec's products use, on every OpenMP thread
// at once: 16 independent accumulator chains per thread, so that throughput, not latency,
// bounds it. Prints "read_gbs <GB/s>" (streaming reads) and "<instruction> <GMAC/s>" lines (scripts/kernel_cost_curves.py reads them).
//
//   g++ -O2 -fopenmp -mavx2 -mfma [-mavx512f -mavx512bw -mavx512vnni -mavx512bf16
//       -DSELFSPEC_PEAK_AVX512] peak_macs.cpp -o peak && OMP_NUM_THREADS=2 ./peak
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>

#include <chrono>
#include <vector>

constexpr long kIters = 20000000;
constexpr int kChains = 16;

template <typename Step>
double rate(double macs_per_op, Step step) {
  const auto start = std::chrono::steady_clock::now();
  double sink = 0;
#pragma omp parallel reduction(+ : sink)
  sink += step();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (sink == 1.25) printf("#\n");  // keeps the work
  return kIters * kChains * macs_per_op * omp_get_max_threads() / s / 1e9;
}

// Read bandwidth of every thread streaming its share of a 1 GiB buffer (best of 5), GB/s.
double read_gbs() {
  const size_t n = size_t(1) << 27;  // 8-byte words
  std::vector<long> buf(n, 1);
  double best = 1e30;
  long sink = 0;
  for (int rep = 0; rep < 5; ++rep) {
    const auto start = std::chrono::steady_clock::now();
#pragma omp parallel for reduction(+ : sink) schedule(static)
    for (size_t i = 0; i < n; i += 8) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&buf[i]));
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&buf[i + 4]));
      sink += _mm256_extract_epi64(_mm256_add_epi64(a, b), 0);
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (s < best) best = s;
  }
  if (sink == 3) printf("#\n");
  return n * 8.0 / best / 1e9;
}

int main() {
  printf("read_gbs %.1f\n", read_gbs());
  printf("fma %.1f\n", rate(8, [] {
    __m256 acc[kChains];
    for (int i = 0; i < kChains; ++i) acc[i] = _mm256_set1_ps(i);
    __m256 a = _mm256_set1_ps(1e-4f), b = _mm256_set1_ps(1e-4f);  // acc grows slowly: no inf
    for (long it = 0; it < kIters; ++it) {
#pragma GCC unroll 16
      for (int i = 0; i < kChains; ++i) acc[i] = _mm256_fmadd_ps(a, b, acc[i]);
      __asm__ volatile("" : "+x"(a));
    }
    float s = 0;
    for (int i = 0; i < kChains; ++i) s += acc[i][0];
    return static_cast<double>(s);
  }));
  printf("vpmaddubsw %.1f\n", rate(32, [] {  // 32 u8 x s8 products a ymm (pairs to int16)
    __m256i acc[kChains];
    for (int i = 0; i < kChains; ++i) acc[i] = _mm256_set1_epi8(static_cast<char>(i));
    __m256i b = _mm256_set1_epi8(3);
    for (long it = 0; it < kIters; ++it) {
#pragma GCC unroll 16
      for (int i = 0; i < kChains; ++i) acc[i] = _mm256_maddubs_epi16(acc[i], b);
      __asm__ volatile("" : "+x"(b));
    }
    long s = 0;
    for (int i = 0; i < kChains; ++i) s += _mm256_extract_epi32(acc[i], 0);
    return static_cast<double>(s);
  }));
#ifdef SELFSPEC_PEAK_AVX512
  printf("vpdpbusd %.1f\n", rate(64, [] {
    __m512i acc[kChains];
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_epi32(i);
    __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(5);
    for (long it = 0; it < kIters; ++it) {
#pragma GCC unroll 16
      for (int i = 0; i < kChains; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
      __asm__ volatile("" : "+v"(a));
    }
    long s = 0;
    for (int i = 0; i < kChains; ++i) s += _mm512_reduce_add_epi32(acc[i]);
    return static_cast<double>(s);
  }));
  printf("vdpbf16ps %.1f\n", rate(32, [] {
    __m512 acc[kChains];
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps(i);
    __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3f80);
    for (long it = 0; it < kIters; ++it) {
#pragma GCC unroll 16
      for (int i = 0; i < kChains; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
      __asm__ volatile("" : "+v"(a));
    }
    float s = 0;
    for (int i = 0; i < kChains; ++i) s += _mm512_reduce_add_ps(acc[i]);
    return static_cast<double>(s);
  }));
#endif
  return 0;
}
