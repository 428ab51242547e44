/* GEMM-only forward of SmolLM2-135M's weight shapes (30 layers and the tied lm_head, 538 MB)
 * through the router's small-M kernel, per token-row count M: the kernel alone, without mlx.
 *
 *   cc -O3 -march=native -pthread -I adaspec/kernels -o /tmp/small_m_gemm \
 *       benchmarks/small_m_gemm.c && /tmp/small_m_gemm [ISA] [REPEATS] [CACHED] [THREADS]
 *
 * ISA 0 auto, 1 AVX2, 2 AVX-512; CACHED 1 times one layer's weights over and over (the
 * arithmetic alone) instead of streaming all of them; THREADS 1 runs one thread's part and
 * times it in that thread's CPU time, which other jobs on a shared machine barely move, 2 the
 * router's two threads in wall time. Each GEMM's best of REPEATS is summed. */
#include "blas_route.c"

#include <stdio.h>

static int one_thread;

static double now(void) {
  struct timespec t;
  clock_gettime(one_thread ? CLOCK_THREAD_CPUTIME_ID : CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void gemm(int M, int N, int K, const float *A, const float *B, float *C) {
  if (one_thread)
    kernel_part(M, N, K, 1.f, A, K, B, K, 0.f, C, N);
  else
    adaspec_small_m_sgemm(1, M, N, K, 1.f, A, K, B, K, 0.f, C, N);
}

static int arg(int argc, char **argv, int i, int fallback, int lo, int hi, const char *name) {
  if (argc <= i) return fallback;
  int v = atoi(argv[i]);
  if (v < lo || v > hi) {
    fprintf(stderr, "%s %s: accepted %d..%d\n", name, argv[i], lo, hi);
    exit(2);
  }
  return v;
}

enum { LAYERS = 30, SHAPES = 7, VOCAB = 49152, MS = 8 };
static const int shape[SHAPES][2] = {{576, 576},  {192, 576},  {192, 576}, {576, 576},
                                     {1536, 576}, {1536, 576}, {576, 1536}}; /* N, K */

int main(int argc, char **argv) {
  int isa = arg(argc, argv, 1, 0, 0, 2, "ISA"), reps = arg(argc, argv, 2, 5, 1, 1000, "REPEATS");
  int cached = arg(argc, argv, 3, 0, 0, 1, "CACHED");
  one_thread = arg(argc, argv, 4, 2, 1, 2, "THREADS") == 1;
  if (adaspec_kernel_isa(isa) < 0) {
    fprintf(stderr, "ISA %d: this CPU cannot run it\n", isa);
    return 2;
  }
  int layers = cached ? 1 : LAYERS;
  long total = cached ? 0 : (long)VOCAB * 576;
  for (int s = 0; s < SHAPES; s++) total += (long)layers * shape[s][0] * shape[s][1];
  float *W = malloc(total * sizeof(float)), *A = malloc(32 * 1536 * sizeof(float));
  float *C = malloc((long)32 * VOCAB * sizeof(float));
  for (long i = 0; i < total; i++) W[i] = (float)((i * 2654435761u) % 1000) * 1e-3f - 0.5f;
  for (int i = 0; i < 32 * 1536; i++) A[i] = (float)(i % 77) * 0.01f;
  static const int Ms[MS] = {1, 2, 4, 8, 12, 16, 24, 32};
  double first = 0;
  printf("kernel %s, %s, %s\n", adaspec_kernel_isa(-1) == 2 ? "avx512" : "avx2",
         cached ? "one layer in cache (ms per 30 layers)" : "538 MB streamed",
         one_thread ? "one thread, CPU time" : "two threads, wall time");
  for (int mi = 0; mi < MS; mi++) {
    int M = Ms[mi];
    double best[LAYERS * SHAPES + 1];
    for (int g = 0; g <= LAYERS * SHAPES; g++) best[g] = 1e9;
    for (int r = 0; r < reps; r++) {
      const float *w = W;
      int g = 0;
      for (int l = 0; l < layers; l++)
        for (int s = 0; s < SHAPES; s++, g++) {
          double t = now();
          gemm(M, shape[s][0], shape[s][1], A, w, C);
          t = now() - t;
          best[g] = t < best[g] ? t : best[g];
          w += (long)shape[s][0] * shape[s][1];
        }
      if (!cached) {
        double t = now();
        gemm(M, VOCAB, 576, A, w, C);
        t = now() - t;
        best[g] = t < best[g] ? t : best[g];
      }
    }
    double sum = 0;
    for (int g = 0; g <= LAYERS * SHAPES; g++) sum += best[g] < 1e9 ? best[g] : 0;
    if (cached) sum *= LAYERS;
    first = M == 1 ? sum : first;
    double flops = 2.0 * (cached ? (double)LAYERS * total : (double)total) * M;
    printf("M=%2d %7.2f ms  ratio %.2f  %6.1f GFLOP/s\n", M, sum * 1e3, sum / first,
           flops / sum / 1e9);
  }
  return 0;
}
