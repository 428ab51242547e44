/* Two versions of the q8 vector kernel in one process, taking turns on a model's weight
 * shapes (random codes, realistic scales), two threads splitting the outputs as the router
 * does: ms per pass over every matrix for 1..32 token rows, and their ratio. A: this tree's
 * kernels/q8_kernel.h; B: the file given as Q8_B (an edited copy; default: A again, which
 * shows the noise). The two must give the same bits, which it checks first.
 *
 *   cc -O3 -march=native -pthread -I adaspec/kernels [-DQ8_B='"/tmp/q8_kernel.h"'] \
 *       -o /tmp/q8_ab benchmarks/q8_kernel_ab.c -lm && /tmp/q8_ab [qwen|smollm2]
 *
 * qwen: Qwen2.5-Coder-1.5B's Q4_K_M shapes (28 layers, Q6_K v and down, the Q6_K head);
 * smollm2: SmolLM2-135M's Q4_1 layers and Q8_0 head. Needs AVX-512 VNNI. */
#include "blas_route.c"

#include <stdio.h>
#include <string.h>

#ifndef Q8_B
#define Q8_B "q8_kernel.h"
#endif

/* B: q8.h's AVX-512 instantiation again, under another prefix, of the file Q8_B */
#define QN(name) name##_b
#define Q8_KERNEL Q8_B
#include "q8_avx512.h"

typedef void (*rows_fn)(int, int, int, const unsigned char *, long, const q8act_t *, float,
                        float, float *, int);
typedef struct {
  int type, n, k;
  unsigned char *packed;
  long group_bytes;
} mat_t;

/* the second thread: the upper half of each job's outputs (whole groups of 16) */
static struct {
  rows_fn f;
  const mat_t *m;
  int rows;
  const q8act_t *a;
  float *C;
} ab_job;
static atomic_int ab_posted, ab_finished;

static int half_of(int n) { return (n / 2) - (n / 2) % Q8_LANES; }

static void *second(void *unused) {
  (void)unused;
  for (int seen = 0;;) {
    while (atomic_load_explicit(&ab_posted, memory_order_acquire) == seen)
      __builtin_ia32_pause();
    seen = atomic_load(&ab_posted);
    int h = half_of(ab_job.m->n);
    const mat_t *m = ab_job.m;
    ab_job.f(m->type, ab_job.rows, m->n - h, m->packed + (long)(h / Q8_LANES) * m->group_bytes,
             m->group_bytes, ab_job.a, 1.f, 0.f, ab_job.C + h, m->n);
    atomic_store_explicit(&ab_finished, seen, memory_order_release);
  }
  return 0;
}

static void gemm(rows_fn f, const mat_t *m, int rows, const float *A, float *C) {
  q8act_t act = q8_quantize(q8_fmt(m->type), rows, m->k, A, m->k);
  ab_job.f = f, ab_job.m = m, ab_job.rows = rows, ab_job.a = &act, ab_job.C = C;
  int s = atomic_load(&ab_posted) + 1;
  atomic_store_explicit(&ab_posted, s, memory_order_release);
  f(m->type, rows, half_of(m->n), m->packed, m->group_bytes, &act, 1.f, 0.f, C, m->n);
  while (atomic_load_explicit(&ab_finished, memory_order_acquire) != s) __builtin_ia32_pause();
}

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
  int smol = argc > 1 && !strcmp(argv[1], "smollm2");
  if (argc > 1 && !smol && strcmp(argv[1], "qwen")) {
    fprintf(stderr, "model %s: accepted: qwen, smollm2\n", argv[1]);
    return 2;
  }
  if (adaspec_kernel_isa(0) != ISA_AVX512 || !q8_cpu512()) {
    fprintf(stderr, "needs AVX-512 VNNI\n");
    return 2;
  }
  const int qwen[7][3] = {{T_Q4_K, 1536, 1536}, {T_Q4_K, 256, 1536}, {T_Q6_K, 256, 1536},
                          {T_Q4_K, 1536, 1536}, {T_Q4_K, 8960, 1536}, {T_Q4_K, 8960, 1536},
                          {T_Q6_K, 1536, 8960}};
  const int smollm2[7][3] = {{T_Q4_1, 576, 576},  {T_Q4_1, 192, 576},  {T_Q4_1, 192, 576},
                             {T_Q4_1, 576, 576},  {T_Q4_1, 1536, 576}, {T_Q4_1, 1536, 576},
                             {T_Q4_1, 576, 1536}};
  const int(*shape)[3] = smol ? smollm2 : qwen;
  int layers = smol ? 30 : 28, count = layers * 7 + 1;
  mat_t *ms = malloc(sizeof(mat_t) * count);
  srand(1);
  for (int i = 0; i < count; i++) {
    int last = i == count - 1, t = last ? (smol ? T_Q8_0 : T_Q6_K) : shape[i % 7][0];
    int n = last ? (smol ? 49152 : 151936) : shape[i % 7][1];
    int k = last ? (smol ? 576 : 1536) : shape[i % 7][2];
    int elems = block_elems(t), bytes = block_bytes(t);
    long row_bytes = (long)(k / elems) * bytes;
    unsigned char *raw = malloc((long)n * row_bytes);
    for (long b = 0; b < (long)n * row_bytes; b++) raw[b] = (unsigned char)rand();
    unsigned short scale = 0x2000; /* the fp16 scales small and finite */
    for (long b = 0; b < (long)n * k / elems; b++) {
      __builtin_memcpy(raw + b * bytes + (t == T_Q6_K ? 208 : 0), &scale, 2);
      if (t == T_Q4_K || t == T_Q4_1) __builtin_memcpy(raw + b * bytes + 2, &scale, 2);
    }
    ms[i] = (mat_t){t, n, k, q8_pack(t, raw, row_bytes, n, k, &ms[i].group_bytes), 0};
    q8_pack(t, raw, row_bytes, Q8_LANES, k, &ms[i].group_bytes); /* one group's size */
    free(raw);
    if (!ms[i].packed) return 3;
  }
  float *A = malloc(32L * 8960 * 4), *C = malloc(32L * 151936 * 4);
  float *C2 = malloc(32L * 151936 * 4);
  for (long i = 0; i < 32L * 8960; i++) A[i] = (float)(rand() % 1000) / 500.f - 1.f;
  pthread_t t;
  pthread_create(&t, 0, second, 0);
  rows_fn fs[2] = {q8_part_rows_avx512, q8_part_rows_b};
  for (int i = 0; i < 8; i++) {
    gemm(fs[0], &ms[i], 13, A, C);
    gemm(fs[1], &ms[i], 13, A, C2);
    if (memcmp(C, C2, 13L * ms[i].n * 4)) {
      printf("A and B differ on matrix %d: not the same arithmetic\n", i);
      return 1;
    }
  }
  const int rows[] = {1, 2, 4, 8, 12, 16, 32};
  double base[2] = {0, 0};
  printf("%s, %d matrices; best of 6 passes each, A and B taking turns\n",
         smol ? "smollm2" : "qwen", count);
  for (int r = 0; r < 7; r++) {
    double best[2] = {1e9, 1e9};
    for (int rep = 0; rep < 6; rep++)
      for (int v = 0; v < 2; v++) {
        double t0 = now();
        for (int i = 0; i < count; i++) gemm(fs[v], &ms[i], rows[r], A, C);
        double dt = now() - t0;
        if (dt < best[v]) best[v] = dt;
      }
    if (r == 0) base[0] = best[0], base[1] = best[1];
    printf("rows %2d  A %7.2f ms (x%.2f)  B %7.2f ms (x%.2f)  B/A %.3f\n", rows[r],
           best[0] * 1e3, best[0] / base[0], best[1] * 1e3, best[1] / base[1], best[1] / best[0]);
  }
  return 0;
}
