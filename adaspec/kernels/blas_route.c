/* cblas_* entry points that send small-M fp32 GEMMs to our own kernel, the rest to a BLAS.
 *
 * mlx's CPU backend computes a Linear layer as cblas_sgemm(RowMajor, NoTrans, Trans, M, N, K,
 * x, W) with M = the number of token rows. Decoding (M = 1) and verifying a draft (M = 2..32)
 * are both limited by reading W from memory, yet the BLAS libraries here pack W for every GEMM
 * with M > 1, so a 2-token verify cost ~1.5x a 1-token step (docs/benchmarks.md). The kernel
 * (small_m.h, AVX2 or AVX-512 chosen at run time) streams each row of W once and multiplies it
 * with all M rows of x while it is in cache, on two threads, so a verify of a few tokens costs
 * about what a 1-token step costs; a row's result is the same for every M.
 *
 * Routing: RowMajor GEMMs with M <= own_rows go to the kernels (A B^T, and A B with a small
 * B, as attention's scores @ V); everything else, and every fp64 / complex GEMM, to the BLAS
 * library. adaspec/kernels/blas.py compiles this file, loads it with RTLD_GLOBAL before mlx,
 * and calls adaspec_blas_route() before any GEMM runs. */

#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };
#define NN_MAX (1L << 20) /* B elements up to which a non-transposed B stays on the kernel */
enum { T_NN = 62 }; /* a source_t type: an fp32 B not transposed (k x n, ldb apart) */

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int,
                         const float *, int, float, float *, int);
typedef void (*dgemm_fn)(int, int, int, int, int, int, double, const double *, int,
                         const double *, int, double, double *, int);
typedef void (*cgemm_fn)(int, int, int, int, int, int, const void *, const void *, int,
                         const void *, int, const void *, void *, int);

static sgemm_fn wide_sgemm;
static dgemm_fn wide_dgemm;
static cgemm_fn wide_cgemm;
static int own_rows = 0;
static unsigned long routed[2];     /* calls sent to: the kernels, the library */
static atomic_ulong routed_ns[2];   /* and the time they took, so a forward's GEMM share is known */

/* ---- the small-M kernel: C[m][n] = alpha * dot(A[m], B[n]) + beta * C[m][n] ---------- */

static inline void put(float *c, float s, float alpha, float beta) {
  *c = beta == 0.f ? alpha * s : alpha * s + beta * *c; /* beta 0: C may hold garbage */
}

#define KEEP_M 4 /* rows above which the kernel holds B in registers (small_m.h) */

/* ---- stored types: GGML's type ids (a weight read at its stored bits, blocks.h) -------- */

enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
       T_Q2_K = 10, T_Q3_K = 11, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_BF16 = 30 };

/* elements and bytes per block of a stored type (0: not a stored type) */
static int block_elems(int type) {
  switch (type) {
    case T_F16: case T_BF16: return 1;
    case T_Q4_0: case T_Q4_1: case T_Q5_0: case T_Q5_1: case T_Q8_0: return 32;
    case T_Q2_K: case T_Q3_K: case T_Q4_K: case T_Q5_K: case T_Q6_K: return 256;
  }
  return 0;
}
static int block_bytes(int type) {
  switch (type) {
    case T_F16: case T_BF16: return 2;
    case T_Q4_0: return 18;
    case T_Q4_1: return 20;
    case T_Q5_0: return 22;
    case T_Q5_1: return 24;
    case T_Q8_0: return 34;
    case T_Q2_K: return 84;
    case T_Q3_K: return 110;
    case T_Q4_K: return 144;
    case T_Q5_K: return 176;
    case T_Q6_K: return 210;
  }
  return 0;
}

/* IEEE half -> float, exactly (subnormals, infinities and NaNs included) */
static inline float half_to_float(unsigned short h) {
  unsigned sign = (unsigned)(h >> 15) << 31, exp = (h >> 10) & 31, man = h & 1023, bits;
  if (exp == 31) bits = sign | 0x7F800000u | (man << 13);
  else if (exp) bits = sign | ((exp + 112) << 23) | (man << 13);
  else if (!man) bits = sign;
  else { /* subnormal: normalize */
    int e = 113;
    while (!(man & 1024)) man <<= 1, e--;
    bits = sign | ((unsigned)e << 23) | ((man & 1023) << 13);
  }
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}
static inline float f16(const unsigned char *p) {
  unsigned short h;
  __builtin_memcpy(&h, p, 2);
  return half_to_float(h);
}

/* Q4_K: the 6-bit scale and min of sub-block s (0..7) from the 12 packed bytes q */
static inline void q4_k_scale(const unsigned char *q, int s, int *sc, int *mn) {
  if (s < 4) {
    *sc = q[s] & 63, *mn = q[s + 4] & 63;
  } else {
    *sc = (q[s + 4] & 15) | ((q[s - 4] >> 6) << 4);
    *mn = (q[s + 4] >> 4) | ((q[s] >> 6) << 4);
  }
}

/* Q3_K: the signed 6-bit scale of sub-block s (0..15) from the 12 packed bytes q */
static inline int q3_k_scale(const unsigned char *q, int s) {
  int lo = (s < 8 ? q[s] : q[s - 8] >> 4) & 15, hi = (q[8 + (s & 3)] >> (2 * (s >> 2))) & 3;
  return (lo | hi << 4) - 32;
}

/* The reference: element i of a row, one scalar operation per numpy operation of the gguf
 * package's dequantization (what the converter writes); the vector loaders in blocks.h
 * compute the same values W at a time, and tests hold all three equal. */
static float stored_value(int type, const unsigned char *row, long i) {
  volatile float t; /* a product rounded on its own before the add, as numpy does */
  const unsigned char *b;
  int o = (int)(i & 31), sc, mn;
  switch (type) {
    case T_F16: return f16(row + 2 * i);
    case T_BF16: {
      unsigned bits = (unsigned)(row[2 * i] | row[2 * i + 1] << 8) << 16;
      float f;
      __builtin_memcpy(&f, &bits, 4);
      return f;
    }
    case T_Q8_0: b = row + (i >> 5) * 34; return (float)(signed char)b[2 + o] * f16(b);
    case T_Q4_0:
      b = row + (i >> 5) * 18;
      return f16(b) * (float)(((o < 16 ? b[2 + o] : b[2 + o - 16] >> 4) & 15) - 8);
    case T_Q4_1:
      b = row + (i >> 5) * 20;
      t = f16(b) * (float)((o < 16 ? b[4 + o] : b[4 + o - 16] >> 4) & 15);
      return t + f16(b + 2);
    case T_Q5_0: {
      b = row + (i >> 5) * 22;
      unsigned qh;
      __builtin_memcpy(&qh, b + 2, 4);
      int q = ((o < 16 ? b[6 + o] : b[6 + o - 16] >> 4) & 15) | (int)((qh >> o) & 1) << 4;
      return f16(b) * (float)(q - 16);
    }
    case T_Q5_1: {
      b = row + (i >> 5) * 24;
      unsigned qh;
      __builtin_memcpy(&qh, b + 4, 4);
      int q = ((o < 16 ? b[8 + o] : b[8 + o - 16] >> 4) & 15) | (int)((qh >> o) & 1) << 4;
      t = f16(b) * (float)q;
      return t + f16(b + 2);
    }
    case T_Q2_K: {
      b = row + (i >> 8) * 84;
      int r = (int)(i & 255), s = r >> 4;
      float dl = f16(b + 80) * (float)(b[s] & 15), ml = f16(b + 82) * (float)(b[s] >> 4);
      t = dl * (float)((b[16 + (r >> 7) * 32 + (r & 31)] >> (2 * ((r >> 5) & 3))) & 3);
      return t - ml;
    }
    case T_Q3_K: {
      b = row + (i >> 8) * 110;
      int r = (int)(i & 255);
      float dl = f16(b + 108) * (float)q3_k_scale(b + 96, r >> 4);
      int ql = (b[32 + (r >> 7) * 32 + (r & 31)] >> (2 * ((r >> 5) & 3))) & 3;
      int hb = (b[r & 31] >> (r >> 5)) & 1;
      return dl * (float)(ql - 4 * (hb ^ 1));
    }
    case T_Q5_K: {
      b = row + (i >> 8) * 176;
      int r = (int)(i & 255), s = r >> 5;
      q4_k_scale(b + 4, s, &sc, &mn);
      float d = f16(b) * (float)sc, dm = f16(b + 2) * (float)mn;
      int ql = (b[48 + (r >> 6) * 32 + (r & 31)] >> (4 * (s & 1))) & 15;
      int hb = (b[16 + (r & 31)] >> s) & 1;
      t = d * (float)(ql | hb << 4);
      return t - dm;
    }
    case T_Q4_K: {
      b = row + (i >> 8) * 144;
      int e = (int)(i & 255), s = e >> 5;
      q4_k_scale(b + 4, s, &sc, &mn);
      float d = f16(b) * (float)sc, dm = f16(b + 2) * (float)mn;
      t = d * (float)((b[16 + (s >> 1) * 32 + (e & 31)] >> ((s & 1) * 4)) & 15);
      return t - dm;
    }
    case T_Q6_K: {
      b = row + (i >> 8) * 210;
      int r = (int)(i & 255), h = r >> 7, r2 = r & 127;
      int lo = (b[h * 64 + (r2 & 63)] >> ((r2 >> 6) * 4)) & 15;
      int hi = (b[128 + h * 32 + (r2 & 31)] >> ((r2 >> 5) * 2)) & 3;
      float d = f16(b + 208) * (float)(signed char)b[192 + (r >> 4)];
      return d * (float)((lo | hi << 4) - 32);
    }
  }
  return 0.f;
}

/* a thread's scratch tile of n floats (kept and grown; 0 when out of memory) */
static float *scratch_tile(long n) {
  static __thread float *tile;
  static __thread long have;
  if (n > have) {
    free(tile);
    tile = aligned_alloc(64, ((n * 4 + 63) / 64) * 64);
    have = tile ? n : 0;
  }
  return tile;
}

static inline float dot_tail(const float *a, const float *b, int k, int K) {
  float s = 0.f;
  for (; k < K; k++) s += a[k] * b[k];
  return s;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_KERNEL 1

static const int lane_ids[8] = {0, 1, 2, 3, 4, 5, 6, 7};

static inline __m256 load8n(const float *p, int n) { /* the first n floats, then zeros */
  __m256i ids = _mm256_loadu_si256((const __m256i *)lane_ids);
  return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), ids));
}

static inline float hsum8(__m256 v) { /* lanes i + i+4, then i + i+2, then i + i+1 */
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* ---- 8 lanes: AVX2 + FMA, tiles of 4 x 3 (12 accumulators) ---------------------------- */

#define W 8
#define MR 4
#define NR 3
#define VEC __m256
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VLOADN(p, n) load8n(p, n)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VHSUM(v) hsum8(v)
#define VKEEP(v) __asm__("" : "+x"(v)) /* v lives in a register here */

/* bf16 -> fp32 is a 16-bit shift: the tail (n < 8) goes through a zero-filled copy */
static inline __m256 load8h(const unsigned short *p) {
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
static inline __m256 load8hn(const unsigned short *p, int n) {
  unsigned short t[8] = {0};
  for (int i = 0; i < n; i++) t[i] = p[i];
  return load8h(t);
}

#define BT float
#define LINE 16
#define VLOADB VLOAD
#define VLOADBN VLOADN
#define FN(name) name##_avx2
#include "small_m.h"
#define BT unsigned short
#define LINE 32
#define VLOADB(p) load8h(p)
#define VLOADBN(p, n) load8hn(p, n)
#define FN(name) name##_avx2_bf16
#include "small_m.h"

#define VI __m256i
#define VLOAD_U8(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define VLOAD_I8(p) _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define VAND(v, c) _mm256_and_si256(v, _mm256_set1_epi32(c))
#define VOR(a, b) _mm256_or_si256(a, b)
#define VSRL(v, n) _mm256_srl_epi32(v, _mm_cvtsi32_si128(n))
#define VSLL(v, n) _mm256_sll_epi32(v, _mm_cvtsi32_si128(n))
#define VSRLV(v, n) _mm256_srlv_epi32(v, n)
#define VSUB_I(v, c) _mm256_sub_epi32(v, _mm256_set1_epi32(c))
#define VADD_I(v, c) _mm256_add_epi32(v, _mm256_set1_epi32(c))
#define VSET1_I(x) _mm256_set1_epi32(x)
#define VLANES() _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)
#define VCVT(v) _mm256_cvtepi32_ps(v)
#define VMUL(a, b) _mm256_mul_ps(a, b)
#define VADD(a, b) _mm256_add_ps(a, b)
#define VSUB(a, b) _mm256_sub_ps(a, b)
#define VSET1(x) _mm256_set1_ps(x)
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
#define VLOAD_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define VLOADB_BF16(p) load8h(p)
#define QFN(name) name##_avx2_q
#define FP32FN(name) name##_avx2
#include "blocks.h"
#undef W
#undef MR
#undef NR
#undef VEC
#undef VZERO
#undef VLOAD
#undef VLOADN
#undef VFMA
#undef VHSUM
#undef VKEEP
#undef VI
#undef VLOAD_U8
#undef VLOAD_I8
#undef VAND
#undef VOR
#undef VSRL
#undef VSLL
#undef VSRLV
#undef VSUB_I
#undef VADD_I
#undef VSET1_I
#undef VLANES
#undef VCVT
#undef VMUL
#undef VADD
#undef VSUB
#undef VSET1
#undef VSTORE
#undef VLOAD_F16
#undef VLOADB_BF16

/* ---- 16 lanes: AVX-512 F, tiles of 4 x 4 (21 of the 32 registers) --------------------- */

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f"))), apply_to = function)
#define HAVE_AVX512 1
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx512f")
#define HAVE_AVX512 1
#endif

#ifdef HAVE_AVX512
static inline float hsum16(__m512 v) { /* lanes i + i+8, then as hsum8 */
  __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  return hsum8(_mm256_add_ps(_mm512_castps512_ps256(v), hi));
}
#define W 16
#define MR 4
#define NR 4
#define VEC __m512
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VLOADN(p, n) _mm512_maskz_loadu_ps((__mmask16)((1u << (n)) - 1), p)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VHSUM(v) hsum16(v)
#define VKEEP(v) __asm__("" : "+v"(v))

static inline __m512 load16h(const unsigned short *p) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
static inline __m512 load16hn(const unsigned short *p, int n) {
  unsigned short t[16] = {0};
  for (int i = 0; i < n; i++) t[i] = p[i];
  return load16h(t);
}

#define BT float
#define LINE 16
#define VLOADB VLOAD
#define VLOADBN VLOADN
#define FN(name) name##_avx512
#include "small_m.h"
#define BT unsigned short
#define LINE 32
#define VLOADB(p) load16h(p)
#define VLOADBN(p, n) load16hn(p, n)
#define FN(name) name##_avx512_bf16
#include "small_m.h"

#define VI __m512i
#define VLOAD_U8(p) _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define VLOAD_I8(p) _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define VAND(v, c) _mm512_and_si512(v, _mm512_set1_epi32(c))
#define VOR(a, b) _mm512_or_si512(a, b)
#define VSRL(v, n) _mm512_srl_epi32(v, _mm_cvtsi32_si128(n))
#define VSLL(v, n) _mm512_sll_epi32(v, _mm_cvtsi32_si128(n))
#define VSRLV(v, n) _mm512_srlv_epi32(v, n)
#define VSUB_I(v, c) _mm512_sub_epi32(v, _mm512_set1_epi32(c))
#define VADD_I(v, c) _mm512_add_epi32(v, _mm512_set1_epi32(c))
#define VSET1_I(x) _mm512_set1_epi32(x)
#define VLANES() _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
#define VCVT(v) _mm512_cvtepi32_ps(v)
#define VMUL(a, b) _mm512_mul_ps(a, b)
#define VADD(a, b) _mm512_add_ps(a, b)
#define VSUB(a, b) _mm512_sub_ps(a, b)
#define VSET1(x) _mm512_set1_ps(x)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define VLOAD_F16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define VLOADB_BF16(p) load16h(p)
#ifndef AVX512_NR1
#define AVX512_NR1 8
#endif
#ifndef AVX512_NR2
#define AVX512_NR2 6
#endif
#define NR1 AVX512_NR1 /* B rows per fused tile of one row of A (blocks.h) */
#define NR2 AVX512_NR2 /* and of two */
#define QFN(name) name##_avx512_q
#define FP32FN(name) name##_avx512
#include "blocks.h"
#endif

#if defined(__clang__)
#pragma clang attribute pop
#elif defined(__GNUC__)
#pragma GCC pop_options
#endif

/* 8 V columns of one row of C from n0 for B not transposed: V accumulators, k in order */
__attribute__((always_inline)) static inline void nn_columns(const int V, const float *a, int K,
                                                             const float *B, int ldb, int n0,
                                                             float al, float be, float *c) {
  __m256 acc[8];
  for (int j = 0; j < V; j++) acc[j] = _mm256_setzero_ps();
  for (int k = 0; k < K; k++) {
    __m256 x = _mm256_set1_ps(a[k]);
    const float *b = B + (long)k * ldb + n0;
    for (int j = 0; j < V; j++) acc[j] = _mm256_fmadd_ps(x, _mm256_loadu_ps(b + 8 * j), acc[j]);
  }
  float out[64];
  for (int j = 0; j < V; j++) _mm256_storeu_ps(out + 8 * j, acc[j]);
  for (int j = 0; j < 8 * V; j++) put(c + n0 + j, out[j], al, be);
}

/* C[m][n] for B not transposed (attention's scores @ V), one row of A at a time: 64 columns
 * at once, then 32, then 8, then one; each output one fma chain over k in order, so a row's
 * result does not depend on M (nor on where a thread's share of N starts) */
static void rows_nn(int M, int N, int K, float al, const float *A, int lda, const float *B,
                    int ldb, float be, float *C, int ldc) {
  for (int m = 0; m < M; m++) {
    const float *a = A + (long)m * lda;
    float *c = C + (long)m * ldc;
    int n0 = 0;
    for (; n0 + 64 <= N; n0 += 64) nn_columns(8, a, K, B, ldb, n0, al, be, c);
    for (; n0 + 32 <= N; n0 += 32) nn_columns(4, a, K, B, ldb, n0, al, be, c);
    for (; n0 + 8 <= N; n0 += 8) nn_columns(1, a, K, B, ldb, n0, al, be, c);
    for (int n = n0; n < N; n++) {
      float s = 0.f;
      for (int k = 0; k < K; k++) s = fmaf(a[k], B[(long)k * ldb + n], s);
      put(c + n, s, al, be);
    }
  }
}

#ifdef HAVE_AVX512
/* R rows of A from a against 16 NV columns of B from b (lanes past `left` masked) */
__attribute__((target("avx512f"), always_inline)) static inline void
nn_tile_avx512(const int R, const int NV, int K, float al, const float *a, int lda,
               const float *b, int ldb, int left, float be, float *c, int ldc) {
  __mmask16 mk[4];
  for (int v = 0; v < NV; v++) {
    int l = left - 16 * v;
    mk[v] = l >= 16 ? 0xffff : l > 0 ? (__mmask16)((1u << l) - 1) : 0;
  }
  __m512 acc[4][4], bv[4];
  for (int r = 0; r < R; r++)
    for (int v = 0; v < NV; v++) acc[r][v] = _mm512_setzero_ps();
  for (int k = 0; k < K; k++, b += ldb) {
    for (int v = 0; v < NV; v++) /* a masked load only where it must be: measured slower */
      bv[v] = left >= 16 * (v + 1) ? _mm512_loadu_ps(b + 16 * v)
                                   : _mm512_maskz_loadu_ps(mk[v], b + 16 * v);
    for (int r = 0; r < R; r++) {
      __m512 x = _mm512_set1_ps(a[(long)r * lda + k]);
      for (int v = 0; v < NV; v++) acc[r][v] = _mm512_fmadd_ps(x, bv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; r++) {
    float out[64];
    for (int v = 0; v < NV; v++) _mm512_storeu_ps(out + 16 * v, acc[r][v]);
    for (int j = 0; j < 16 * NV && j < left; j++) put(c + (long)r * ldc + j, out[j], al, be);
  }
}

/* the same sums on AVX-512: 4 rows of A share each load of B, 16 outputs a vector, up to 4
 * vectors a tile; each output is still one fma chain over k in order */
__attribute__((target("avx512f"))) static void rows_nn_avx512(int M, int N, int K, float al,
                                                               const float *A, int lda,
                                                               const float *B, int ldb, float be,
                                                               float *C, int ldc) {
  int m0 = 0;
  for (; m0 + 4 <= M; m0 += 4)
    for (int n0 = 0; n0 < N; n0 += 64) {
      const float *a = A + (long)m0 * lda;
      float *c = C + (long)m0 * ldc + n0;
      int R = 4, NV = (N - n0 + 15) / 16 < 4 ? (N - n0 + 15) / 16 : 4;
      switch (4 * (R - 1) + NV - 1) {
#define NN_T(r, nv)                                                                            \
  case 4 * (r - 1) + nv - 1:                                                                   \
    nn_tile_avx512(r, nv, K, al, a, lda, B + n0, ldb, N - n0, be, c, ldc);                     \
    break;
        NN_T(4, 1) NN_T(4, 2) NN_T(4, 3) NN_T(4, 4)
#undef NN_T
      }
    }
  if (m0 < M) /* fewer than 4 rows left: measured faster one at a time on AVX2 */
    rows_nn(M - m0, N, K, al, A + (long)m0 * lda, lda, B, ldb, be, C + (long)m0 * ldc, ldc);
}
#endif

typedef void (*part_fn)(int, int, int, float, const float *, int, const float *, int, float,
                        float *, int);
typedef void (*part16_fn)(int, int, int, float, const float *, int, const unsigned short *, int,
                          float, float *, int);
typedef void (*blocks_fn)(int, int, int, float, const float *, int, const unsigned char *, int,
                          long, float, float *, int);
typedef void (*row_fn)(int, const unsigned char *, float *, int);
enum { ISA_NONE = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };
static part_fn kernel_part = part_avx2;
static part_fn nn_rows = rows_nn; /* B not transposed */
static part16_fn kernel_part16 = part_avx2_bf16;
static blocks_fn kernel_blocks = part_blocks_avx2_q;
static row_fn kernel_row = dequant_row_avx2_q;
static int isa = ISA_AVX2;

/* the kernel for an instruction set: 0 = the best this CPU has, 1 = AVX2, 2 = AVX-512, -1 =
 * keep the current one. Returns the one in use, or -1 when this CPU cannot run the one asked
 * for (the kernel is then unchanged). */
int adaspec_kernel_isa(int want) {
  if (want == -1) return isa;
  int has512 = 0;
#ifdef HAVE_AVX512
  __builtin_cpu_init();
  has512 = __builtin_cpu_supports("avx512f");
#endif
  if (want == ISA_NONE) want = has512 ? ISA_AVX512 : ISA_AVX2;
  if (want != ISA_AVX2 && !(want == ISA_AVX512 && has512)) return -1;
#ifdef HAVE_AVX512
  kernel_part = want == ISA_AVX512 ? part_avx512 : part_avx2;
  kernel_part16 = want == ISA_AVX512 ? part_avx512_bf16 : part_avx2_bf16;
  kernel_blocks = want == ISA_AVX512 ? part_blocks_avx512_q : part_blocks_avx2_q;
  kernel_row = want == ISA_AVX512 ? dequant_row_avx512_q : dequant_row_avx2_q;
  nn_rows = want == ISA_AVX512 ? rows_nn_avx512 : rows_nn;
#endif
  isa = want;
  return isa;
}
#include "q8.h"
#else
#define HAVE_KERNEL 0
enum { T_Q8P = 63 };
#define Q8_LANES 16
typedef struct q8act q8act_t;
static int q8_vector(void) { return 0; }
static void q8_part(int type, int M, int N, const unsigned char *data, long group_bytes,
                    const q8act_t *a, float al, float be, float *C, int ldc) {
  (void)type, (void)M, (void)N, (void)data, (void)group_bytes, (void)a, (void)al, (void)be;
  (void)C, (void)ldc; /* never called: without the kernels nothing is packed */
}
enum { ISA_NONE = 0 };
static int isa = ISA_NONE;
int adaspec_kernel_isa(int want) { return want <= ISA_NONE ? ISA_NONE : -1; }
static void rows_nn(int M, int N, int K, float al, const float *A, int lda, const float *B,
                    int ldb, float be, float *C, int ldc) {
  for (int m = 0; m < M; m++)
    for (int n = 0; n < N; n++) {
      float s = 0.f;
      for (int k = 0; k < K; k++) s += A[(long)m * lda + k] * B[(long)k * ldb + n];
      put(C + (long)m * ldc + n, s, al, be);
    }
}
#define nn_rows rows_nn
static void kernel_part(int M, int N, int K, float al, const float *A, int lda, const float *B,
                        int ldb, float be, float *C, int ldc) {
  for (int m = 0; m < M; m++)
    for (int n = 0; n < N; n++)
      put(C + (long)m * ldc + n, dot_tail(A + (long)m * lda, B + (long)n * ldb, 0, K), al, be);
}
static void kernel_part16(int M, int N, int K, float al, const float *A, int lda,
                          const unsigned short *B, int ldb, float be, float *C, int ldc) {
  (void)M, (void)N, (void)K, (void)al, (void)A, (void)lda, (void)B, (void)ldb, (void)be;
  (void)C, (void)ldc; /* never called: without the kernels no shadow is registered */
}
static void kernel_blocks(int M, int N, int K, float al, const float *A, int lda,
                          const unsigned char *B, int type, long row_bytes, float be, float *C,
                          int ldc) {
  (void)M, (void)N, (void)K, (void)al, (void)A, (void)lda, (void)B, (void)type;
  (void)row_bytes, (void)be, (void)C, (void)ldc; /* never called: no blocks are registered */
}
static void kernel_row(int type, const unsigned char *row, float *out, int K) {
  for (int e = 0; e < K; e++) out[e] = stored_value(type, row, e);
}
#endif

/* Where a GEMM reads B from: the fp32 array itself (type T_F32), or a stand-in registered
 * for it: a bf16 copy (a drafter's shadow, or a target's bf16 original) read by the bf16
 * kernel, or stored blocks widened a few rows at a time (blocks.h). */
typedef struct {
  int type;
  const unsigned char *data; /* row 0 of the stand-in */
  long row_bytes;            /* T_Q8P: a group's bytes / 16; T_NN: 4 (a column) */
  int q8type;                /* T_Q8P: the type packed */
  const q8act_t *act;        /* T_Q8P: the quantized rows of A */
} source_t;
static const source_t FP32 = {T_F32, 0, 0, 0, 0};

static source_t rows_from(source_t s, int h) { /* the same source from row h on */
  if (s.type != T_F32) s.data += (long)h * s.row_bytes;
  return s;
}

/* one thread's share of a GEMM: all M rows of A against rows [0, N) of B (or its stand-in) */
static void part_any(int M, int N, int K, float al, const float *A, int lda, const float *B,
                     source_t src, int ldb, float be, float *C, int ldc) {
  if (src.type == T_F32)
    kernel_part(M, N, K, al, A, lda, B, ldb, be, C, ldc);
  else if (src.type == T_BF16)
    kernel_part16(M, N, K, al, A, lda, (const unsigned short *)src.data,
                  (int)(src.row_bytes / 2), be, C, ldc);
  else if (src.type == T_NN)
    nn_rows(M, N, K, al, A, lda, (const float *)src.data, ldb, be, C, ldc);
  else if (src.type == T_Q8P)
    q8_part(src.q8type, M, N, src.data, src.row_bytes * Q8_LANES, src.act, al, be, C, ldc);
  else
    kernel_blocks(M, N, K, al, A, lda, src.data, src.type, src.row_bytes, be, C, ldc);
}

/* ---- two threads: the caller takes the first half of N, one worker the second --------- */

typedef struct {
  int M, N, K, lda, ldb, ldc;
  float al, be;
  const float *A, *B;
  source_t src;
  float *C;
  void (*fn)(void *, int); /* set: not a GEMM, fn(ctx, 0) and fn(ctx, 1) (adaspec_split2) */
  void *ctx;
} job_t;

static job_t job;
/* posted: jobs posted; claimed: the newest job whose second half someone took (the worker,
 * or the caller itself when the worker has not started on it by the time the caller's own
 * half is done: under CPU contention the worker may not be running at all); finished: the
 * newest job the worker completed. */
static atomic_uint posted, claimed, finished;
static atomic_int busy;
static int worker_started;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
#ifndef SPLIT_MIN
#define SPLIT_MIN (1L << 15) /* B elements below which a GEMM stays on one thread, */
#endif
#ifndef SPLIT_WORK
#define SPLIT_WORK (1L << 16) /* unless it has this many multiply-adds (attention's, a few rows) */
#endif
#define SPINS 200000 /* ~ms of polling after a job before the worker sleeps */

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

/* whole tiles of 1, 2, 3 or 6 rows of B; whole groups of a packed copy */
static int split(source_t src, int N) {
  return (N / 2) - (N / 2) % (src.type == T_Q8P || src.type == T_NN ? 16 : 6);
}

static unsigned start_seen; /* jobs posted before the worker was created */

/* half `second` of a job: of a GEMM, the outputs from split() on or before it */
static void run_half(const job_t *j, int second) {
  if (j->fn) {
    j->fn(j->ctx, second);
    return;
  }
  int h = split(j->src, j->N);
  if (!second)
    part_any(j->M, h, j->K, j->al, j->A, j->lda, j->B, j->src, j->ldb, j->be, j->C, j->ldc);
  else
    part_any(j->M, j->N - h, j->K, j->al, j->A, j->lda, j->B ? j->B + (long)h * j->ldb : 0,
             rows_from(j->src, h), j->ldb, j->be, j->C + h, j->ldc);
}

/* set on the worker thread: a GEMM it makes itself (a half of adaspec_split2's work) is not
 * on the clock of the calling thread, which the routed counters keep */
static __thread int on_worker;

static void *worker(void *unused) {
  (void)unused;
  on_worker = 1;
  unsigned seen = start_seen;
  for (;;) {
    unsigned s;
    long spins = 0;
    while ((s = atomic_load_explicit(&posted, memory_order_acquire)) == seen) {
      if (++spins > SPINS) {
        pthread_mutex_lock(&mu);
        while (atomic_load(&posted) == seen) pthread_cond_wait(&wake, &mu);
        pthread_mutex_unlock(&mu);
        spins = 0;
      }
      relax();
      if ((spins & 63) == 0) sched_yield(); /* let other work in while idle */
    }
    seen = s;
    unsigned expect = s - 1;
    if (!atomic_compare_exchange_strong(&claimed, &expect, s)) continue; /* caller took it */
    run_half(&job, 1);
    atomic_store_explicit(&finished, s, memory_order_release);
  }
  return 0;
}

static void after_fork_in_child(void) {
  worker_started = 0; /* the worker thread does not exist in a forked child */
  atomic_store(&claimed, atomic_load(&posted));
  atomic_store(&finished, atomic_load(&posted));
  atomic_store(&busy, 0);
}

/* j's first half here and its second on the worker at once (or here too, when the worker has
 * not started on it by the time the first is done: under CPU contention the worker may not be
 * running at all); 0 when another thread is using the worker or it cannot start (nothing ran) */
static int run_split(const job_t *j) {
  if (atomic_exchange(&busy, 1)) return 0;
  if (!worker_started) {
    pthread_t t;
    pthread_atfork(0, 0, after_fork_in_child);
    start_seen = atomic_load(&posted);
    if (pthread_create(&t, 0, worker, 0) != 0) {
      atomic_store(&busy, 0);
      return 0;
    }
    pthread_detach(t);
    worker_started = 1;
  }
  job = *j;
  pthread_mutex_lock(&mu);
  unsigned s = atomic_fetch_add_explicit(&posted, 1, memory_order_release) + 1;
  pthread_cond_signal(&wake);
  pthread_mutex_unlock(&mu);
  run_half(j, 0);
  unsigned expect = s - 1;
  if (atomic_compare_exchange_strong(&claimed, &expect, s)) {
    run_half(j, 1); /* the worker has not started on it: do it here rather than wait */
  } else {
    for (long spins = 0; atomic_load_explicit(&finished, memory_order_acquire) != s; spins++) {
      relax();
      if (spins > 1000) sched_yield(); /* the worker was preempted: give it the core */
    }
  }
  atomic_store(&busy, 0);
  return 1;
}

static void kernel(int M, int N, int K, float al, const float *A, int lda, const float *B,
                   source_t src, int ldb, float be, float *C, int ldc) {
  /* little work (attention's scores at a short context): stay on this thread */
  job_t j = {M, N, K, lda, ldb, ldc, al, be, A, B, src, C, 0, 0};
  if (((long)N * K < SPLIT_MIN && (long)M * N * K < SPLIT_WORK) || N < 12 || !run_split(&j))
    part_any(M, N, K, al, A, lda, B, src, ldb, be, C, ldc);
}

/* fn(ctx, 0) on this thread and fn(ctx, 1) on the GEMM worker at once (a native node's two
 * halves of independent work: attention's heads); both here, one after the other, when the
 * worker is in use. A GEMM either half makes runs on its own thread alone. */
void adaspec_split2(void (*fn)(void *, int), void *ctx) {
  job_t j = {0};
  j.fn = fn, j.ctx = ctx;
  if (!run_split(&j)) fn(ctx, 0), fn(ctx, 1);
}

/* ---- stand-ins -------------------------------------------------------------------------
 * What the kernel reads in place of an fp32 weight matrix B, found in cblas_sgemm by B's
 * address, shape and stride:
 * - a bf16 shadow: a copy of a drafter's fp32 matrix, which still exists. Results differ
 *   from fp32 by bf16's rounding; any other GEMM (a view, another shape, a prefill) reads
 *   the fp32 data.
 * - stored bits (exact): a weight as its file stores it (GGUF blocks, 2-byte floats), whose
 *   widened values are exactly the fp32 expansion's. No fp32 data lies behind it: the array
 *   mlx holds is a view of the stored bytes with the matrix's shape (kernels/stored.py), so
 *   every GEMM on it must come here: up to own_rows rows to the kernel, more (a prefill) to
 *   the library a tile of widened rows at a time; any other use stops the process with a
 *   message rather than read past the bytes.
 * The caller keeps B and its stand-in alive while registered. Writers (add, remove) take a
 * lock; readers (every GEMM) find an entry by its address, published last. */

#define SLOTS 8192 /* a power of two: ~7 weight matrices per layer */
typedef struct {
  const float *_Atomic w; /* 0: never used; GONE: removed */
  const unsigned char *data;
  int type, n, k, ld, exact;
  long row_bytes;
  int q8;                 /* GEMMs on it use the 8-bit arithmetic (q8.h) */
  unsigned char *packed;  /* its packed copy for the vector kernel (0: the reference) */
  long group_bytes;
} standin_t;
static standin_t standins[SLOTS];
static atomic_int n_standins;
static atomic_ulong shadow_calls, stored_calls[2]; /* stored: by the kernel, by the library */
static atomic_ulong q8_calls, q8_bytes; /* GEMMs in the 8-bit arithmetic; its copies' bytes */
/* per type id of a stand-in, the kernel's GEMMs on it: calls, nanoseconds, bytes of B read */
static atomic_ulong by_type[32][3];
static pthread_mutex_t standin_mu = PTHREAD_MUTEX_INITIALIZER;
#define GONE ((const float *)1)

static inline unsigned standin_slot(const float *w) {
  return (unsigned)((((unsigned long)w >> 6) * 2654435761ul) & (SLOTS - 1));
}

/* w's entry, or 0; with `free`, also the first slot a new entry for w may take (0: none) */
static standin_t *standin_locate(const float *w, standin_t **free) {
  if (free) *free = 0;
  for (unsigned i = standin_slot(w), probe = 0; probe < SLOTS; probe++) {
    standin_t *s = &standins[(i + probe) & (SLOTS - 1)];
    const float *at = atomic_load_explicit(&s->w, memory_order_acquire);
    if (at == w) return s;
    if (free && !*free && (at == GONE || !at)) *free = s;
    if (!at) return 0;
  }
  return 0;
}

static const standin_t *standin_find(const float *b) {
  if (!atomic_load_explicit(&n_standins, memory_order_acquire)) return 0;
  return standin_locate(b, 0);
}

static int standin_put(standin_t e) {
  if (!HAVE_KERNEL) return -2;
  pthread_mutex_lock(&standin_mu);
  standin_t *slot, *found = standin_locate(e.w, &slot);
  int rc = found ? -1 : 0;
  if (!found && slot && atomic_load(&n_standins) < SLOTS / 2) {
    const float *w = e.w;
    e.w = 0;
    *slot = e;
    atomic_store_explicit(&slot->w, w, memory_order_release);
    atomic_fetch_add(&n_standins, 1);
    rc = 1;
  }
  pthread_mutex_unlock(&standin_mu);
  return rc;
}

/* register h (n rows of k bf16 values, ld apart) as the shadow of fp32 matrix w: 1 done,
 * 0 the table is full, -1 w already has a stand-in, -2 without the kernels (nothing would
 * read it) */
int adaspec_shadow_add(const float *w, int n, int k, int ld, const unsigned short *h) {
  return standin_put((standin_t){w, (const unsigned char *)h, T_BF16, n, k, ld, 0, 2L * ld, 0, 0, 0});
}

/* register the n x k matrix stored at w as `type` (a GGML type id): rows of k / block
 * elements blocks, one after the other. Returns as adaspec_shadow_add, and -3 for a type
 * it cannot read or a k that is not a multiple of 32. */
int adaspec_stored_add(const float *w, int type, int n, int k) {
  int elems = block_elems(type);
  if (!elems || k <= 0 || k % 32 || n <= 0) return -3;
  long row_bytes = (long)(k / elems) * block_bytes(type);
  return standin_put((standin_t){w, (const unsigned char *)w, type, n, k, k, 1, row_bytes, 0, 0, 0});
}

/* unregister w's stand-in: 1 done, 0 it had none */
int adaspec_shadow_remove(const float *w) {
  pthread_mutex_lock(&standin_mu);
  standin_t *s = standin_locate(w, 0);
  if (s) {
    atomic_store_explicit(&s->w, GONE, memory_order_release);
    atomic_fetch_sub(&n_standins, 1);
    if (s->packed)
      atomic_fetch_sub(&q8_bytes, (unsigned long)((s->n + Q8_LANES - 1) / Q8_LANES) * s->group_bytes);
    free(s->packed);
    s->packed = 0, s->q8 = 0;
  }
  pthread_mutex_unlock(&standin_mu);
  return s != 0;
}

#if HAVE_KERNEL
/* the arithmetic of GEMMs on the n x k fp32 matrix w (rows ld floats apart, or its stored
 * stand-in): on 1 the 8-bit one (q8.h), 0 exact. A matrix without a stand-in gets one that
 * reads w itself. Returns the bytes of the packed copy (0: its GEMMs run the scalar
 * reference: no VNNI), -1 the table is full, -2 no kernels, -3 a shape the format cannot
 * take, -4 out of memory. */
long adaspec_q8_use(const float *w, int n, int k, int ld, int on) {
  standin_t *s = (standin_t *)standin_find(w);
  if (!s && on) {
    if (k % 32 || n <= 0) return -3;
    standin_t e = {w, (const unsigned char *)w, T_F32, n, k, ld, 0, 4L * ld, 0, 0, 0};
    if (standin_put(e) != 1) return -1;
    s = (standin_t *)standin_find(w);
  }
  if (!s) return 0;
  int type = s->exact ? s->type : T_F32;
  q8fmt_t f = q8_fmt(type);
  if (!f.sb || k % f.sb || s->n != n || s->k != k) return -3;
  s->q8 = on;
  return q8_vector() ? (long)((n + Q8_LANES - 1) / Q8_LANES) * (k / f.sb) * q8_layout(f).unit : 0;
}

/* s's packed copy, made by its first q8 GEMM (a matrix only gathered from, an embedding, never
 * takes the memory); 0 when the vector kernel does not run or memory ran out */
static const unsigned char *q8_packed(standin_t *s, const float *w) {
  if (s->packed || !q8_vector()) return s->packed;
  pthread_mutex_lock(&standin_mu);
  if (!s->packed) {
    int type = s->exact ? s->type : T_F32;
    s->packed = q8_pack(type, s->exact ? s->data : (const unsigned char *)w,
                        s->exact ? s->row_bytes : 4L * s->ld, s->n, s->k, &s->group_bytes);
    if (s->packed) atomic_fetch_add(&q8_bytes, (unsigned long)((s->n + Q8_LANES - 1) / Q8_LANES) * s->group_bytes);
  }
  pthread_mutex_unlock(&standin_mu);
  return s->packed;
}

/* the kernel q8 GEMMs run on: 2 AVX-512 VNNI, 1 AVX2, 0 the scalar reference */
int adaspec_q8_kernel(void) { return q8_vector() ? 1 + q8_vnni() : 0; }

/* bytes of the packed copies made so far (and not yet freed) */
unsigned long adaspec_q8_packed_bytes(void) { return atomic_load(&q8_bytes); }

/* a GEMM in the 8-bit arithmetic on B = data (`type`, rows row_bytes apart), packed or not */
static void q8_gemm(int type, const unsigned char *data, long row_bytes,
                    const unsigned char *packed, long group_bytes, int m, int n, int k, float al,
                    const float *a, int lda, float be, float *c, int ldc) {
  q8act_t act = q8_quantize(q8_fmt(type), m, k, a, lda);
  if (packed) {
    source_t src = {T_Q8P, packed, group_bytes / Q8_LANES, type, &act};
    kernel(m, n, k, al, a, lda, 0, src, 0, be, c, ldc);
  } else {
    q8_reference(type, data, row_bytes, m, n, &act, al, be, c, ldc);
  }
}

/* the quantized activations alone, for tests: m rows of A (k floats each) for weights of
 * `type` into codes[m][k] and the sums of each sub-block's codes sums[m][k / sub-block];
 * returns the sub-block size, or -3 for a type or k it cannot take */
int adaspec_q8_activations(int type, int m, int k, const float *A, signed char *codes,
                           int *sums) {
  q8fmt_t f = q8_fmt(type);
  if (!f.sb || k % f.sb) return -3;
  q8act_t a = q8_quantize(f, m, k, A, k);
  for (int r = 0; r < m; r++) {
    __builtin_memcpy(codes + (long)r * k, q8_codes(&a, r), k);
    __builtin_memcpy(sums + (long)r * a.nsub, q8_bsum(&a, r), sizeof(int) * a.nsub);
  }
  return f.s;
}

/* the 8-bit GEMM alone, for tests: C = alpha * A B^T + beta * C with B n x k of `type` (a
 * GGML type id; 0: floats). vector 1: packed, on the vector kernel; 0: the reference.
 * Returns 0, or -2 (vector asked, no VNNI), -3 (a type or k it cannot take), -4 (memory). */
int adaspec_q8_sgemm(int vector, int type, int M, int N, int K, float alpha, const float *A,
                     int lda, const unsigned char *B, float beta, float *C, int ldc) {
  q8fmt_t f = q8_fmt(type);
  if (!f.sb || K % f.sb) return -3;
  if (vector && !q8_vector()) return -2;
  long rb = type == T_F32 ? 4L * K : (long)(K / block_elems(type)) * block_bytes(type), gb = 0;
  unsigned char *packed = vector ? q8_pack(type, B, rb, N, K, &gb) : 0;
  if (vector && !packed) return -4;
  q8_gemm(type, B, rb, packed, gb, M, N, K, alpha, A, lda, beta, C, ldc);
  free(packed);
  return 0;
}
#else
long adaspec_q8_use(const float *w, int n, int k, int ld, int on) {
  (void)w, (void)n, (void)k, (void)ld, (void)on;
  return -2;
}
#endif

/* routed GEMMs that read a bf16 shadow so far */
unsigned long adaspec_shadow_calls(void) { return atomic_load(&shadow_calls); }

/* GEMMs in the 8-bit arithmetic so far */
unsigned long adaspec_q8_calls(void) { return atomic_load(&q8_calls); }

/* GEMMs that read stored bits: out[0] by the kernel, out[1] by the library (prefill) */
void adaspec_stored_calls(unsigned long *out) {
  out[0] = atomic_load(&stored_calls[0]);
  out[1] = atomic_load(&stored_calls[1]);
}

/* the kernel's GEMMs on stand-ins of GGML type id `type` so far: calls, ns, bytes read */
void adaspec_stored_type_stats(int type, unsigned long *out) {
  for (int i = 0; i < 3; i++) out[i] = atomic_load(&by_type[type & 31][i]);
}

/* the fp32 values of `rows` rows of k elements stored as `type`, row_bytes apart:
 * vector 0 = the reference (one scalar operation per numpy operation), 1 = the kernel's */
void adaspec_stored_values(int vector, int type, const unsigned char *src, int rows, int k,
                           long row_bytes, float *out) {
  for (int r = 0; r < rows; r++)
    if (vector)
      kernel_row(type, src + (long)r * row_bytes, out + (long)r * k, k);
    else
      for (int e = 0; e < k; e++) out[(long)r * k + e] = stored_value(type, src + (long)r * row_bytes, e);
}

#define WIDE_WHOLE (1L << 25) /* floats: B widened whole for the library up to this size */
#define WIDE_TILE (1L << 22)  /* floats of widened rows per library call beyond it */
#define KEEP_SCRATCH (1L << 24) /* floats of a wide scratch kept for the next call */

/* a GEMM of more rows than the kernel takes (a prefill) on stored B: the library on B's
 * widened values. The library's sums depend on the shapes it is given (OpenBLAS: a row's
 * result changes with N and with M), so B is widened whole, and the result is the fp32
 * expansion's bit for bit, up to WIDE_WHOLE floats (every matrix of the catalogue's models
 * but the largest output heads); a larger B goes in tiles of rows, within rounding of it. */
static void wide_stored(int m, int n, int k, float al, const float *a, int lda,
                        const standin_t *s, float be, float *c, int ldc) {
  static __thread float *tile;
  static __thread long have;
  int per = (long)n * k <= WIDE_WHOLE ? n : (int)(WIDE_TILE / k > 0 ? WIDE_TILE / k : 1);
  long need = (long)per * k;
  if (need > have) {
    free(tile);
    tile = malloc(need * sizeof(float));
    have = tile ? need : 0;
    if (!tile) abort();
  }
  for (int n0 = 0; n0 < n; n0 += per) {
    int nr = n - n0 < per ? n - n0 : per;
    for (int j = 0; j < nr; j++)
      kernel_row(s->type, s->data + (long)(n0 + j) * s->row_bytes, tile + (long)j * k, k);
    wide_sgemm(ROW_MAJOR, NO_TRANS, TRANS, m, nr, k, al, a, lda, tile, k, be, c + n0, ldc);
  }
  if (have > KEEP_SCRATCH) free(tile), tile = 0, have = 0;
}

static void refuse(const standin_t *s, const char *why) {
  fprintf(stderr,
          "adaspec: a %dx%d weight read at its stored bits (type %d) was used in a GEMM the "
          "router cannot serve (%s); set ADASPEC_STORED_WEIGHTS=off to load fp32 weights\n",
          s->n, s->k, s->type, why);
  abort();
}

/* ---- the entry points ------------------------------------------------------------------ */

/* GEMMs with M <= kernel_rows go to the kernels, the rest to the library's functions.
 * Returns whether this build has the vectorized kernels (without them, pass kernel_rows 0). */
int adaspec_blas_route(sgemm_fn sgemm, dgemm_fn dgemm, cgemm_fn cgemm, int kernel_rows) {
  wide_sgemm = sgemm;
  wide_dgemm = dgemm;
  wide_cgemm = cgemm;
  own_rows = kernel_rows;
  return HAVE_KERNEL;
}

/* fp32 GEMM calls so far: to the kernels, to the library; then nanoseconds spent in each */
void adaspec_blas_routed(unsigned long *out) {
  out[0] = routed[0];
  out[1] = routed[1];
  out[2] = atomic_load(&routed_ns[0]);
  out[3] = atomic_load(&routed_ns[1]);
}

static inline unsigned long now_ns(void) { /* ~20 ns through the vDSO, per GEMM call */
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (unsigned long)t.tv_sec * 1000000000ul + (unsigned long)t.tv_nsec;
}

/* the kernels alone, for tests: C = alpha * A B^T (trans_b) or A B, + beta * C */
void adaspec_small_m_sgemm(int trans_b, int M, int N, int K, float alpha, const float *A,
                           int lda, const float *B, int ldb, float beta, float *C, int ldc) {
  if (trans_b)
    kernel(M, N, K, alpha, A, lda, B, FP32, ldb, beta, C, ldc);
  else
    kernel(M, N, K, alpha, A, lda, 0, (source_t){T_NN, (const unsigned char *)B, 4, 0, 0}, ldb,
           beta, C, ldc);
}

/* the bf16 kernel alone, for tests: C = alpha * A Bh^T + beta * C */
void adaspec_small_m_sgemm_bf16(int M, int N, int K, float alpha, const float *A, int lda,
                                const unsigned short *Bh, int ldb, float beta, float *C,
                                int ldc) {
  source_t src = {T_BF16, (const unsigned char *)Bh, 2L * ldb};
  kernel(M, N, K, alpha, A, lda, 0, src, ldb, beta, C, ldc);
}

/* the kernel on stored B alone, for tests: C = alpha * A B^T + beta * C with B's n x k
 * values stored as `type` (rows of k elements, one after the other) */
void adaspec_small_m_sgemm_stored(int M, int N, int K, float alpha, const float *A, int lda,
                                  const unsigned char *B, int type, float beta, float *C,
                                  int ldc) {
  source_t src = {type, B, (long)(K / block_elems(type)) * block_bytes(type)};
  kernel(M, N, K, alpha, A, lda, 0, src, K, beta, C, ldc);
}

void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha, const float *a,
                 int lda, const float *b, int ldb, float beta, float *c, int ldc) {
  unsigned long t = now_ns();
  int to = 0;
  const standin_t *s = standin_find(b), *typed = 0; /* typed: a stand-in the kernel read */
  int plain = order == ROW_MAJOR && ta == NO_TRANS && tb == TRANS;
  if (s && !(plain && s->n == n && s->k == k && s->ld == ldb)) {
    if (s->exact) refuse(s, plain ? "another shape or stride" : "a transposed or column-major operand");
    s = 0; /* a shadow: this GEMM reads the fp32 matrix */
  }
  if (s && s->q8) {
    int type = s->exact ? s->type : T_F32;
    const unsigned char *packed = q8_packed((standin_t *)s, b);
    q8_gemm(type, s->exact ? s->data : (const unsigned char *)b, s->exact ? s->row_bytes : 4L * ldb,
            packed, s->group_bytes, m, n, k, alpha, a, lda, beta, c, ldc);
    atomic_fetch_add(&q8_calls, 1);
    typed = s;
  } else if (s && s->exact && m > own_rows) {
    to = 1;
    wide_stored(m, n, k, alpha, a, lda, s, beta, c, ldc);
    atomic_fetch_add(&stored_calls[1], 1);
  } else if (m <= own_rows && plain) {
    source_t src = s ? (source_t){s->type, s->data, s->row_bytes} : FP32;
    kernel(m, n, k, alpha, a, lda, b, src, ldb, beta, c, ldc);
    if (s) atomic_fetch_add(s->exact ? &stored_calls[0] : &shadow_calls, 1);
    typed = s;
  } else if (m <= own_rows && order == ROW_MAJOR && ta == NO_TRANS && tb == NO_TRANS &&
             (long)n * k <= NN_MAX) {
    source_t src = {T_NN, (const unsigned char *)b, 4, 0, 0};
    kernel(m, n, k, alpha, a, lda, 0, src, ldb, beta, c, ldc);
  } else {
    to = 1;
    wide_sgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
  unsigned long dt = now_ns() - t;
  if (!on_worker) {
    routed[to]++;
    atomic_fetch_add(&routed_ns[to], dt);
  }
  if (typed) {
    atomic_fetch_add(&by_type[typed->type & 31][0], 1);
    atomic_fetch_add(&by_type[typed->type & 31][1], dt);
    atomic_fetch_add(&by_type[typed->type & 31][2], (unsigned long)n * typed->row_bytes);
  }
}

void cblas_dgemm(int order, int ta, int tb, int m, int n, int k, double alpha, const double *a,
                 int lda, const double *b, int ldb, double beta, double *c, int ldc) {
  wide_dgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void cblas_cgemm(int order, int ta, int tb, int m, int n, int k, const void *alpha,
                 const void *a, int lda, const void *b, int ldb, const void *beta, void *c,
                 int ldc) {
  wide_cgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
