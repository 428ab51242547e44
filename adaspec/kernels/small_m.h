/* The small-M GEMM kernel, C = alpha A B^T + beta C, written once over vectors of W floats
 * and included by blas_route.c once per instruction set and type of B (the V* macros, BT and
 * FN name them): B is fp32, or a bf16 shadow of an fp32 weight matrix (VLOADB widens it to
 * fp32 in registers; A, the sums and C stay fp32). LINE is B's elements per cache line.
 *
 * Every C[m][n] is one function of A[m][:], B[n][:] and K alone: lane l of a W-wide
 * accumulator adds A[m][k] B[n][k] for k = l (mod W) in increasing k, by fused multiply-adds
 * from zero (K's tail through a zero-filled load), and the W lanes are then added by one fixed
 * tree (VHSUM). Tiles, K blocks, the number of rows M and the split between threads change
 * which sums run side by side, never the order within one, so a token row's result does not
 * depend on how many rows share the GEMM: a verify's logits equal a 1-token step's bit for
 * bit.
 *
 * NR rows of B at a time are read from memory once and multiplied with every group of MR rows
 * of A while they sit in L1; the next NR rows are prefetched meanwhile, so streaming the
 * weights overlaps the arithmetic. Each group of A's rows asks for its share of those lines:
 * asked all by the first group, they queued behind each other and the later groups computed
 * on an idle memory bus (one thread, streaming SmolLM2's weights: M = 16 61 vs 79 ms,
 * M = 32 100 vs 123 ms). The lines are asked into L2, not L1: a tile of B (NR rows of K
 * floats), the next one and M rows of A overflow L1's 32 KB from M = 2 on at K = 896, and
 * lines evicted before use stalled the stream (Qwen2.5-0.5B's lm_head, one thread, AVX-512:
 * M = 2 21 vs 40 ms, M = 8 31 vs 54 ms; M = 1 unchanged). (Blocking K as well was measured
 * slower here: it breaks the weights' sequential stream for M = 1 and gained nothing for
 * larger M.)
 *
 * Above KEEP_M rows the kernel is bound by its arithmetic, and the rows of B are held in
 * registers (VKEEP) for all rows of A; left alone, the compiler folds them into the FMAs as
 * memory operands, one load per FMA. Up to KEEP_M rows the weights' stream is the limit, and
 * those folded loads measured faster (AVX-512, SmolLM2's shapes, one thread: M = 4 39 vs
 * 45 ms streaming; M = 8 57 vs 65 ms, M = 32 2.4 vs 3.1 ms per layer in cache with VKEEP). */

typedef struct {
  const BT *at;  /* 0: nothing to prefetch */
  int rows, len; /* rows of B (ldb apart), elements per row from `at` */
  int first, count; /* this tile's share: `count` lines from line `first` of those rows */
} FN(ahead_t);

/* rows [0, mr) of A against rows [0, nr) of B */
static inline __attribute__((always_inline)) void FN(tile)(int mr, int nr, int K,
                                                           const float *A, long lda,
                                                           const BT *B, long ldb, float al,
                                                           float be, float *C, long ldc,
                                                           FN(ahead_t) pf, int keep) {
  VEC acc[MR][NR];
  for (int i = 0; i < mr; i++)
    for (int j = 0; j < nr; j++) acc[i][j] = VZERO();
  /* lines of the next tile to ask for per W floats, walked row by row without a division */
  int lpr = (pf.len + LINE - 1) / LINE, left = pf.at ? pf.count : 0;
  int steps = (K + W - 1) / W, per = (left + steps - 1) / (steps ? steps : 1);
  const BT *row = pf.at ? pf.at + (long)(pf.first / lpr) * ldb : 0;
  int col = pf.at ? (pf.first % lpr) * LINE : 0;
  int k = 0;
  for (; k + W <= K; k += W) {
    for (int l = 0; l < per && left > 0; l++, left--) {
      __builtin_prefetch(row + col, 0, 2); /* into L2: see above */
      if ((col += LINE) >= pf.len) col = 0, row += ldb;
    }
    VEC b[NR];
    for (int j = 0; j < nr; j++) {
      b[j] = VLOADB(B + j * ldb + k);
      if (keep && mr > 1) VKEEP(b[j]);
    }
    for (int i = 0; i < mr; i++) {
      VEC a = VLOAD(A + i * lda + k);
      if (keep && mr > 1 && nr > 1) VKEEP(a);
      for (int j = 0; j < nr; j++) acc[i][j] = VFMA(a, b[j], acc[i][j]);
    }
  }
  if (k < K) { /* K's tail: the missing lanes load as zero */
    VEC b[NR];
    for (int j = 0; j < nr; j++) b[j] = VLOADBN(B + j * ldb + k, K - k);
    for (int i = 0; i < mr; i++) {
      VEC a = VLOADN(A + i * lda + k, K - k);
      for (int j = 0; j < nr; j++) acc[i][j] = VFMA(a, b[j], acc[i][j]);
    }
  }
  for (int i = 0; i < mr; i++)
    for (int j = 0; j < nr; j++) put(C + i * ldc + j, VHSUM(acc[i][j]), al, be);
}

/* the tile with its shape (and keep) as constants, so the accumulators stay in registers */
#define TILE_CASE(r, c)                                                                    \
  case (r) * 8 + (c):                                                                      \
    if ((r) <= MR && (c) <= NR)                                                            \
      FN(tile)(r, c, K, A, lda, B, ldb, al, be, C, ldc, pf, 0);                            \
    break;                                                                                 \
  case 64 + (r) * 8 + (c):                                                                 \
    if ((r) <= MR && (c) <= NR)                                                            \
      FN(tile)(r, c, K, A, lda, B, ldb, al, be, C, ldc, pf, 1);                            \
    break;
#define TILE_ROW(r) TILE_CASE(r, 1) TILE_CASE(r, 2) TILE_CASE(r, 3) TILE_CASE(r, 4)

static void FN(tile_any)(int mr, int nr, int K, const float *A, long lda, const BT *B,
                         long ldb, float al, float be, float *C, long ldc, FN(ahead_t) pf,
                         int keep) {
  switch ((keep ? 64 : 0) + mr * 8 + nr) { TILE_ROW(1) TILE_ROW(2) TILE_ROW(3) TILE_ROW(4) }
}
#undef TILE_ROW
#undef TILE_CASE

/* one thread's share: all M rows of A against rows [0, N) of B */
static void FN(part)(int M, int N, int K, float al, const float *A, int lda, const BT *B,
                     int ldb, float be, float *C, int ldc) {
  for (int n = 0; n < N; n += NR) {
    int nr = N - n < NR ? N - n : NR;
    FN(ahead_t) next = {0, 0, K, 0, 0}; /* the next NR rows of B */
    if (n + NR < N) {
      next.at = B + (long)(n + NR) * ldb;
      next.rows = N - n - NR < NR ? N - n - NR : NR;
    }
    int groups = (M + MR - 1) / MR, lines = next.rows * ((K + LINE - 1) / LINE);
    for (int m = 0, g = 0; m < M; m += MR, g++) {
      /* every row group asks for its share, so the requests spread over the whole tile */
      next.first = (int)((long)lines * g / groups);
      next.count = (int)((long)lines * (g + 1) / groups) - next.first;
      FN(tile_any)(M - m < MR ? M - m : MR, nr, K, A + (long)m * lda, lda, B + (long)n * ldb,
                   ldb, al, be, C + (long)m * ldc + n, ldc, next, M > KEEP_M);
    }
  }
}

/* B's type and the names are the includer's to set again for the next type; the vector
 * parameters (W ... VKEEP) stay until it undefines them for the next instruction set */
#undef FN
#undef BT
#undef LINE
#undef VLOADB
#undef VLOADBN
