/* This machine's limits, for the roofline that `adaspec doctor` and benchmarks/forward_cost.py
 * print beside the forward times: memory bandwidth (a STREAM-like triad, and a read-only sum,
 * which is how a forward streams its weights) and the peak fp32 FMA rate, on `threads`
 * threads. Built and loaded like blas_route.c (adaspec/kernels/blas.py). */

#include <pthread.h>
#include <stdlib.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

typedef struct {
  float *a, *b, *c;
  long n;
  int reps, kind;
  double sink;
} part_t;

static void *stream_part(void *arg) {
  part_t *p = arg;
  float s = 1.0001f;
  double acc = 0;
  for (int r = 0; r < p->reps; r++) {
    if (p->kind == 0) {
      for (long i = 0; i < p->n; i++) p->a[i] = p->b[i] + s * p->c[i];
    } else {
      float t[16] = {0};
      for (long i = 0; i + 16 <= p->n; i += 16)
        for (int j = 0; j < 16; j++) t[j] += p->b[i + j];
      for (int j = 0; j < 16; j++) acc += t[j];
    }
  }
  p->sink = acc;
  return 0;
}

/* kind 0: triad a = b + s c (12 bytes moved per element); kind 1: sum of b (4 bytes).
 * n: elements per array (make the arrays far larger than the caches). Returns GB/s, the
 * best of `reps` passes, or -1 if memory or threads could not be had. */
double adaspec_stream_gbs(int kind, long n, int threads, int reps) {
  if (threads < 1 || threads > 64 || n < 64 * threads) return -1;
  float *a = malloc(n * sizeof(float)), *b = malloc(n * sizeof(float)),
        *c = malloc(n * sizeof(float));
  double best = -1;
  if (a && b && c) {
    for (long i = 0; i < n; i++) a[i] = 0.f, b[i] = 1.f, c[i] = 2.f;
    part_t parts[64];
    pthread_t tid[64];
    long chunk = n / threads;
    for (int r = 0; r < reps; r++) {
      double t0 = now();
      for (int i = 0; i < threads; i++) {
        parts[i] = (part_t){a + i * chunk, b + i * chunk, c + i * chunk, chunk, 1, kind, 0};
        if (i > 0) pthread_create(&tid[i], 0, stream_part, &parts[i]);
      }
      stream_part(&parts[0]);
      for (int i = 1; i < threads; i++) pthread_join(tid[i], 0);
      double dt = now() - t0;
      double gbs = (kind == 0 ? 12.0 : 4.0) * chunk * threads / dt / 1e9;
      if (gbs > best) best = gbs;
    }
  }
  free(a);
  free(b);
  free(c);
  return best;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define CHAINS 10 /* independent FMA chains: latency 4-5 cycles x 2 pipes */

typedef struct {
  long iters;
  float out;
} fma_t;

static void *fma_part(void *arg) {
  fma_t *p = arg;
  __m256 acc[CHAINS], x = _mm256_set1_ps(0.999999f), y = _mm256_set1_ps(1e-7f);
  for (int j = 0; j < CHAINS; j++) acc[j] = _mm256_set1_ps((float)j);
  for (long i = 0; i < p->iters; i++)
    for (int j = 0; j < CHAINS; j++) acc[j] = _mm256_fmadd_ps(acc[j], x, y);
  float s = 0, o[8];
  for (int j = 0; j < CHAINS; j++) {
    _mm256_storeu_ps(o, acc[j]);
    for (int l = 0; l < 8; l++) s += o[l];
  }
  p->out = s;
  return 0;
}

/* peak fp32 GFLOP/s with 256-bit FMAs on `threads` threads (an FMA counts 2 flops);
 * -1 without AVX2/FMA */
double adaspec_peak_gflops(int threads, long iters) {
  if (threads < 1 || threads > 64) return -1;
  fma_t parts[64];
  pthread_t tid[64];
  double best = -1;
  for (int r = 0; r < 3; r++) {
    double t0 = now();
    for (int i = 0; i < threads; i++) {
      parts[i] = (fma_t){iters, 0};
      if (i > 0) pthread_create(&tid[i], 0, fma_part, &parts[i]);
    }
    fma_part(&parts[0]);
    for (int i = 1; i < threads; i++) pthread_join(tid[i], 0);
    double g = 2.0 * 8 * CHAINS * (double)iters * threads / (now() - t0) / 1e9;
    if (g > best) best = g;
  }
  return best;
}
#else
double adaspec_peak_gflops(int threads, long iters) {
  (void)threads;
  (void)iters;
  return -1;
}
#endif
