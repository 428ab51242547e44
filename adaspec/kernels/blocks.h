/* Weights read at their stored bits: GGUF blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q6_K) and
 * 2-byte floats (F16, BF16), widened in registers to exactly the fp32 values of their
 * expansion. Included by blas_route.c once per instruction set, after small_m.h's fp32 kernel
 * (whose vector macros W, VEC, ... are still defined); QFN names this set's functions.
 *
 * A value is the expansion's when every rounding step is the expansion's: each type is the
 * gguf package's numpy dequantization (the converter's) step by step, one IEEE operation per
 * numpy operation. A multiply followed by an add or subtract must round twice, as numpy does,
 * so the product passes through ROUNDED (an empty asm the compiler cannot fuse across).
 *
 * A row of B is dequantized NR rows at a time into a scratch tile that the fp32 kernel's tile
 * reads (tile_any: all row groups of A, the same sums in the same order as on the fp32
 * expansion), so a token row's result equals the fp32 kernel's bit for bit and so does not
 * depend on the number of rows. Every type's row length is a multiple of 32 elements and W
 * (8 or 16) divides 32, so a vector never straddles two blocks and K has no tail. */

#define ROUNDED(v) VKEEP(v)

static inline VEC QFN(scaled)(VI q, float d) { /* d * float(q) */
  return VMUL(VCVT(q), VSET1(d));
}

/* W values of a row from element e (a multiple of W) on */
static inline VEC QFN(q8_0)(const unsigned char *row, int e) {
  const unsigned char *b = row + (long)(e >> 5) * 34;
  return QFN(scaled)(VLOAD_I8(b + 2 + (e & 31)), f16(b));
}

static inline VI QFN(nibbles)(const unsigned char *qs, int o) { /* o < 16: low, else high */
  VI q = VLOAD_U8(qs + (o & 15));
  return VAND(o < 16 ? q : VSRL(q, 4), 15);
}

static inline VEC QFN(q4_0)(const unsigned char *row, int e) {
  const unsigned char *b = row + (long)(e >> 5) * 18;
  return QFN(scaled)(VSUB_I(QFN(nibbles)(b + 2, e & 31), 8), f16(b));
}

static inline VEC QFN(q4_1)(const unsigned char *row, int e) {
  const unsigned char *b = row + (long)(e >> 5) * 20;
  VEC v = QFN(scaled)(QFN(nibbles)(b + 4, e & 31), f16(b));
  ROUNDED(v);
  return VADD(v, VSET1(f16(b + 2)));
}

static inline VEC QFN(q5_0)(const unsigned char *row, int e) {
  const unsigned char *b = row + (long)(e >> 5) * 22;
  unsigned qh;
  __builtin_memcpy(&qh, b + 2, 4);
  VI hi = VAND(VSRLV(VSET1_I((int)qh), VADD_I(VLANES(), e & 31)), 1);
  VI q = VOR(QFN(nibbles)(b + 6, e & 31), VSLL(hi, 4));
  return QFN(scaled)(VSUB_I(q, 16), f16(b));
}

static inline VEC QFN(q4_k)(const unsigned char *row, int e) {
  const unsigned char *b = row + (long)(e >> 8) * 144;
  int s = (e & 255) >> 5, sc, mn;
  q4_k_scale(b + 4, s, &sc, &mn);
  float d = f16(b) * (float)sc, dm = f16(b + 2) * (float)mn;
  VI q = VAND(VSRL(VLOAD_U8(b + 16 + (s >> 1) * 32 + (e & 31)), (s & 1) * 4), 15);
  VEC v = VMUL(VCVT(q), VSET1(d));
  ROUNDED(v);
  return VSUB(v, VSET1(dm));
}

static inline VEC QFN(q6_k)(const unsigned char *row, int e) {
  const unsigned char *b = row + (long)(e >> 8) * 210;
  int r = e & 255, h = r >> 7, r2 = r & 127;
  VI lo = VAND(VSRL(VLOAD_U8(b + h * 64 + (r2 & 63)), (r2 >> 6) * 4), 15);
  VI hi = VAND(VSRL(VLOAD_U8(b + 128 + h * 32 + (r2 & 31)), (r2 >> 5) * 2), 3);
  float d = f16(b + 208) * (float)(signed char)b[192 + (r >> 4)];
  return QFN(scaled)(VSUB_I(VOR(lo, VSLL(hi, 4)), 32), d);
}

static inline VEC QFN(f16)(const unsigned char *row, int e) {
  return VLOAD_F16(row + 2L * e);
}

static inline VEC QFN(bf16)(const unsigned char *row, int e) {
  return VLOADB_BF16((const unsigned short *)(row + 2L * e));
}

/* the fp32 values of elements [0, K) of a row of `type` */
static void QFN(dequant_row)(int type, const unsigned char *row, float *out, int K) {
#define ROW_LOOP(f)                                                                          \
  for (int e = 0; e < K; e += W) VSTORE(out + e, QFN(f)(row, e));                            \
  break;
  switch (type) {
    case T_Q8_0: ROW_LOOP(q8_0)
    case T_Q4_0: ROW_LOOP(q4_0)
    case T_Q4_1: ROW_LOOP(q4_1)
    case T_Q5_0: ROW_LOOP(q5_0)
    case T_Q4_K: ROW_LOOP(q4_k)
    case T_Q6_K: ROW_LOOP(q6_k)
    case T_F16: ROW_LOOP(f16)
    case T_BF16: ROW_LOOP(bf16)
  }
#undef ROW_LOOP
}

/* one thread's share: all M rows of A against rows [0, N) of B stored as `type` */
static void QFN(part_blocks)(int M, int N, int K, float al, const float *A, int lda,
                             const unsigned char *B, int type, long row_bytes, float be,
                             float *C, int ldc) {
  float *s = scratch_tile(NR * (long)K);
  if (!s) abort(); /* out of memory for a few rows of floats */
  FP32FN(ahead_t) none = {0, 0, K, 0, 0};
  for (int n = 0; n < N; n += NR) {
    int nr = N - n < NR ? N - n : NR;
    for (int j = 0; j < nr; j++) {
      const unsigned char *row = B + (long)(n + j) * row_bytes;
      /* the row NR further on, into L2 while this one is widened */
      if (n + j + NR < N)
        for (long o = 0; o < row_bytes; o += 64) __builtin_prefetch(row + NR * row_bytes + o, 0, 2);
      QFN(dequant_row)(type, row, s + (long)j * K, K);
    }
    for (int m = 0; m < M; m += MR)
      FP32FN(tile_any)(M - m < MR ? M - m : MR, nr, K, A + (long)m * lda, lda, s, K, al, be,
                       C + (long)m * ldc + n, ldc, none, M > KEEP_M);
  }
}

#undef ROUNDED
#undef QFN
#undef FP32FN
