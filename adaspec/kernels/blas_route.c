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
#include <stdlib.h>
#include <time.h>

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };
#define NN_MAX (1L << 20) /* B elements up to which a non-transposed B stays on one thread */

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
#endif

#if defined(__clang__)
#pragma clang attribute pop
#elif defined(__GNUC__)
#pragma GCC pop_options
#endif

/* C[m][n0..n0+64) for B not transposed (attention's scores @ V): 8 accumulators along n, k in
 * order, so a row's result does not depend on M either */
static void rows_nn(int M, int N, int K, float al, const float *A, int lda, const float *B,
                    int ldb, float be, float *C, int ldc) {
  for (int m = 0; m < M; m++) {
    const float *a = A + (long)m * lda;
    float *c = C + (long)m * ldc;
    int n0 = 0;
    for (; n0 + 64 <= N; n0 += 64) {
      __m256 acc[8];
      for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
      for (int k = 0; k < K; k++) {
        __m256 x = _mm256_set1_ps(a[k]);
        const float *b = B + (long)k * ldb + n0;
        for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(x, _mm256_loadu_ps(b + 8 * j), acc[j]);
      }
      float out[64];
      for (int j = 0; j < 8; j++) _mm256_storeu_ps(out + 8 * j, acc[j]);
      for (int j = 0; j < 64; j++) put(c + n0 + j, out[j], al, be);
    }
    for (int n = n0; n < N; n++) {
      float s = 0.f;
      for (int k = 0; k < K; k++) s = fmaf(a[k], B[(long)k * ldb + n], s);
      put(c + n, s, al, be);
    }
  }
}

typedef void (*part_fn)(int, int, int, float, const float *, int, const float *, int, float,
                        float *, int);
typedef void (*part16_fn)(int, int, int, float, const float *, int, const unsigned short *, int,
                          float, float *, int);
enum { ISA_NONE = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };
static part_fn kernel_part = part_avx2;
static part16_fn kernel_part16 = part_avx2_bf16;
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
#endif
  isa = want;
  return isa;
}
#else
#define HAVE_KERNEL 0
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
#endif

/* one thread's share of a GEMM whose B is fp32 (Bh 0) or has a bf16 shadow Bh */
static void part_any(int M, int N, int K, float al, const float *A, int lda, const float *B,
                     const unsigned short *Bh, int ldb, float be, float *C, int ldc) {
  if (Bh)
    kernel_part16(M, N, K, al, A, lda, Bh, ldb, be, C, ldc);
  else
    kernel_part(M, N, K, al, A, lda, B, ldb, be, C, ldc);
}

/* ---- two threads: the caller takes the first half of N, one worker the second --------- */

typedef struct {
  int M, N, K, lda, ldb, ldc;
  float al, be;
  const float *A, *B;
  const unsigned short *Bh;
  float *C;
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
#define SPLIT_MIN (1L << 15) /* B elements below which a GEMM stays on one thread */
#endif
#define SPINS 200000 /* ~ms of polling after a job before the worker sleeps */

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

static int split(int N) { return (N / 2) - (N / 2) % 6; } /* whole tiles of 1, 2, 3 or 6 */

static unsigned start_seen; /* jobs posted before the worker was created */

static void *worker(void *unused) {
  (void)unused;
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
    int h = split(job.N);
    part_any(job.M, job.N - h, job.K, job.al, job.A, job.lda, job.B + (long)h * job.ldb,
             job.Bh ? job.Bh + (long)h * job.ldb : 0, job.ldb, job.be, job.C + h, job.ldc);
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

static void kernel(int M, int N, int K, float al, const float *A, int lda, const float *B,
                   const unsigned short *Bh, int ldb, float be, float *C, int ldc) {
  /* little work (attention's scores at a short context), or another thread is already
   * using the worker: stay on this thread */
  if ((long)N * K < SPLIT_MIN || N < 12 || atomic_exchange(&busy, 1)) {
    part_any(M, N, K, al, A, lda, B, Bh, ldb, be, C, ldc);
    return;
  }
  if (!worker_started) {
    pthread_t t;
    pthread_atfork(0, 0, after_fork_in_child);
    start_seen = atomic_load(&posted);
    if (pthread_create(&t, 0, worker, 0) != 0) {
      atomic_store(&busy, 0);
      part_any(M, N, K, al, A, lda, B, Bh, ldb, be, C, ldc);
      return;
    }
    pthread_detach(t);
    worker_started = 1;
  }
  job = (job_t){M, N, K, lda, ldb, ldc, al, be, A, B, Bh, C};
  pthread_mutex_lock(&mu);
  unsigned s = atomic_fetch_add_explicit(&posted, 1, memory_order_release) + 1;
  pthread_cond_signal(&wake);
  pthread_mutex_unlock(&mu);
  int h = split(N);
  part_any(M, h, K, al, A, lda, B, Bh, ldb, be, C, ldc);
  unsigned expect = s - 1;
  if (atomic_compare_exchange_strong(&claimed, &expect, s)) {
    /* the worker has not started on it: do the second half here rather than wait for it */
    part_any(M, N - h, K, al, A, lda, B + (long)h * ldb, Bh ? Bh + (long)h * ldb : 0, ldb, be,
             C + h, ldc);
  } else {
    for (long spins = 0; atomic_load_explicit(&finished, memory_order_acquire) != s; spins++) {
      relax();
      if (spins > 1000) sched_yield(); /* the worker was preempted: give it the core */
    }
  }
  atomic_store(&busy, 0);
}

/* ---- bf16 shadows ----------------------------------------------------------------------
 * A shadow is a bf16 copy of an fp32 weight matrix (a drafter's, never the target's) that the
 * kernel reads in its place: half the bytes to stream for a result within bf16's rounding of
 * the fp32 one. It is found by the address, shape and stride of B in cblas_sgemm; a GEMM on any
 * other B (a view into the matrix, another shape) reads the fp32 data. The caller keeps both
 * arrays alive while the shadow is registered. Writers (add, remove) take a lock; readers
 * (every routed GEMM) find an entry by its address, published last. */

#define SHADOW_SLOTS 4096 /* a power of two: ~7 weight matrices per layer of a draft model */
typedef struct {
  const float *_Atomic w; /* 0: never used; GONE: removed */
  const unsigned short *h;
  int n, k, ld;
} shadow_t;
static shadow_t shadows[SHADOW_SLOTS];
static atomic_int n_shadows;
static atomic_ulong shadow_calls;
static pthread_mutex_t shadow_mu = PTHREAD_MUTEX_INITIALIZER;
#define GONE ((const float *)1)

static inline unsigned shadow_slot(const float *w) {
  return (unsigned)((((unsigned long)w >> 6) * 2654435761ul) & (SHADOW_SLOTS - 1));
}

/* w's entry, or 0; with `free`, also the first slot a new entry for w may take (0: none) */
static shadow_t *shadow_locate(const float *w, shadow_t **free) {
  if (free) *free = 0;
  for (unsigned i = shadow_slot(w), probe = 0; probe < SHADOW_SLOTS; probe++) {
    shadow_t *s = &shadows[(i + probe) & (SHADOW_SLOTS - 1)];
    const float *at = atomic_load_explicit(&s->w, memory_order_acquire);
    if (at == w) return s;
    if (free && !*free && (at == GONE || !at)) *free = s;
    if (!at) return 0;
  }
  return 0;
}

static const unsigned short *shadow_find(const float *b, int n, int k, int ld) {
  if (!atomic_load_explicit(&n_shadows, memory_order_acquire)) return 0;
  const shadow_t *s = shadow_locate(b, 0);
  return s && s->n == n && s->k == k && s->ld == ld ? s->h : 0;
}

/* register h (n rows of k bf16 values, ld apart) as the shadow of w: 1 done, 0 the table is
 * full, -1 w already has one, -2 without the kernels (nothing would read it) */
int adaspec_shadow_add(const float *w, int n, int k, int ld, const unsigned short *h) {
  if (!HAVE_KERNEL) return -2;
  pthread_mutex_lock(&shadow_mu);
  shadow_t *slot, *found = shadow_locate(w, &slot);
  int rc = found ? -1 : 0;
  if (!found && slot && atomic_load(&n_shadows) < SHADOW_SLOTS / 2) {
    slot->h = h, slot->n = n, slot->k = k, slot->ld = ld;
    atomic_store_explicit(&slot->w, w, memory_order_release);
    atomic_fetch_add(&n_shadows, 1);
    rc = 1;
  }
  pthread_mutex_unlock(&shadow_mu);
  return rc;
}

/* unregister w's shadow: 1 done, 0 it had none */
int adaspec_shadow_remove(const float *w) {
  pthread_mutex_lock(&shadow_mu);
  shadow_t *s = shadow_locate(w, 0);
  if (s) {
    atomic_store_explicit(&s->w, GONE, memory_order_release);
    atomic_fetch_sub(&n_shadows, 1);
  }
  pthread_mutex_unlock(&shadow_mu);
  return s != 0;
}

/* routed GEMMs that read a shadow so far */
unsigned long adaspec_shadow_calls(void) { return atomic_load(&shadow_calls); }

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
    kernel(M, N, K, alpha, A, lda, B, 0, ldb, beta, C, ldc);
  else
    rows_nn(M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

/* the bf16 kernel alone, for tests: C = alpha * A Bh^T + beta * C */
void adaspec_small_m_sgemm_bf16(int M, int N, int K, float alpha, const float *A, int lda,
                                const unsigned short *Bh, int ldb, float beta, float *C,
                                int ldc) {
  kernel(M, N, K, alpha, A, lda, 0, Bh, ldb, beta, C, ldc);
}

void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha, const float *a,
                 int lda, const float *b, int ldb, float beta, float *c, int ldc) {
  unsigned long t = now_ns();
  int to = 0;
  if (m <= own_rows && order == ROW_MAJOR && ta == NO_TRANS && tb == TRANS) {
    const unsigned short *h = shadow_find(b, n, k, ldb);
    kernel(m, n, k, alpha, a, lda, b, h, ldb, beta, c, ldc);
    if (h) atomic_fetch_add(&shadow_calls, 1);
  } else if (m <= own_rows && order == ROW_MAJOR && ta == NO_TRANS && tb == NO_TRANS &&
             (long)n * k <= NN_MAX) {
    rows_nn(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  } else {
    to = 1;
    wide_sgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
  routed[to]++;
  atomic_fetch_add(&routed_ns[to], now_ns() - t);
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
