/* The q8 vector kernel, included by q8.h once per instruction set with its macros (QN names
 * this set's functions, QL its lanes: a packed group's 16 lanes are 64 / (4 QL) vectors side
 * by side). Every operation on a lane is the same in both sets, so they give the same bits. */

#define QINLINE static inline __attribute__((always_inline)) QTARGET

/* sub-block j's codes of QL lanes of a unit (p: the sub-block, at the first lane's dword):
 * w[t] holds quad t (4 consecutive k) per lane */
QINLINE void QN(q8_weights)(const int S, const int BITS, const int HB, const unsigned char *p,
                            long pf, QI *w) {
  const int T = S / 4, half = T / 2;
  for (int i = 0; pf && i < (BITS == 8 ? T : half + (HB > 0)); i++) /* pf bytes ahead */
    _mm_prefetch((const char *)p + pf + 64 * i, _MM_HINT_T0);
  if (BITS == 8) {
    for (int t = 0; t < T; t++) w[t] = QLOADI(p + 64 * t);
    return;
  }
  const QI low = QSET1_8(15);
  for (int pr = 0; pr < half; pr++) {
    QI v = QLOADI(p + 64 * pr);
    w[pr] = QAND(v, low);
    w[pr + half] = QAND(QSRLI16(v, 4), low);
  }
  if (!HB) return;
  const QI H = QLOADI(p + 64 * half);
  const QI mask = QSET1_8((char)(((1 << HB) - 1) << 4));
  for (int t = 0; t < T; t++) {
    int s = 4 - t * HB; /* the high bits of quad t to bits 4.. of each byte */
    QI hv = s >= 0 ? QSLLI16(H, s) : QSRLI16(H, -s);
    w[t] = QOR(w[t], QAND(hv, mask));
  }
}

QINLINE QI QN(q8_dot)(const int BITS, QI acc, QI w, const signed char *p) {
  (void)BITS;
  QDOT_DEF
}

QINLINE QI QN(q8_pairs)(QI acc, QI w, const short *p) { QPAIRS_DEF }

/* R token rows from r0 against lanes l0.. of one unit u (super-block sb of a group): acc (one
 * vector of QL floats a row, in registers across the group's super-blocks) += the unit's
 * share of those outputs */
QINLINE void QN(q8_unit)(const int R, const int SB, const int S, const int BITS, const int HB,
                         const int OFF, const int SC, const int MN, const unsigned char *u,
                         q8layout_t o, int l0, int sb, const q8act_t *a, int r0, QF *acc,
                         long pf) {
  const int NSUB = SB / S, T = S / 4, DUAL = R <= QDUAL; /* enough chains hide the latency */
  const int START = OFF && !(BITS == 8 && QOFF_IN_DOT); /* a dot starts at -off * sum(qa) */
  QI isum[Q8_ROWS];
  for (int j = 0; j < NSUB; j++) {
    QI w[8], d0[Q8_ROWS], d1[Q8_ROWS];
    QN(q8_weights)(S, BITS, HB, u + o.planes + j * o.sub_bytes + 4 * l0, pf, w);
    int at = sb * SB + j * S, sub = sb * NSUB + j;
    for (int r = 0; r < R; r++) {
      d0[r] = START ? QSET1_32(q8_obs(a, r0 + r)[sub]) : QZERO();
      d1[r] = QZERO();
    }
    for (int t = 0; t < T; t += 2)
      for (int r = 0; r < R; r++) {
        const signed char *qa = q8_codes(a, r0 + r) + at + 4 * t;
        d0[r] = QN(q8_dot)(BITS, d0[r], w[t], qa);
        if (DUAL)
          d1[r] = QN(q8_dot)(BITS, d1[r], w[t + 1], qa + 4);
        else
          d0[r] = QN(q8_dot)(BITS, d0[r], w[t + 1], qa + 4);
      }
    QI scv = SC ? QI8(u + o.sc + 16 * j + l0) : QZERO();
    for (int r = 0; r < R; r++) {
      QI dot = DUAL ? QADD32(d0[r], d1[r]) : d0[r];
      isum[r] = !SC ? dot : j ? QADD32(isum[r], QMUL32(dot, scv)) : QMUL32(dot, scv);
    }
  }
  QF dv = QHALF(u + 2 * l0), dmv = MN ? QHALF(u + o.dmin + 2 * l0) : QFZERO();
  QI mnp[8]; /* sub-mins j and j + 1 of each lane as two 16-bit halves */
  for (int i = 0; MN == 2 && i < NSUB / 2; i++) {
    const unsigned char *m = u + o.mn + 32 * i + l0;
    mnp[i] = QOR(QU8(m), QSLLI32(QU8(m + 16), 16));
  }
  for (int r = 0; r < R; r++) {
    QF da = QFSET1(q8_da(a, r0 + r)[sb]);
    QF v = acc[r];
    v = QFMADD(QFMUL(dv, da), QCVTF(isum[r]), v);
    if (MN) {
      QI imin = QSET1_32(q8_bsum(a, r0 + r)[sb * NSUB]);
      if (MN == 2) {
        const short *bs = q8_bsum16(a, r0 + r) + sb * NSUB;
        imin = QZERO();
        for (int i = 0; i < NSUB / 2; i++) imin = QN(q8_pairs)(imin, mnp[i], bs + 2 * i);
      }
      v = QFNMADD(QFMUL(dmv, da), QCVTF(imin), v);
    }
    acc[r] = v;
  }
}

/* all M rows against the groups of N outputs packed at data: per group, up to 8 rows at a
 * time over all its super-blocks, their sums in registers (a later pass over the same rows
 * reads the group again, from cache). Each output adds its super-blocks in increasing order.
 * Prefetched (Q8_PF 0: never): in one pass, Q8_PF bytes ahead of the weights read; in P
 * passes, the next group, its p-th P-th share in pass p, a piece before each unit, so memory
 * keeps streaming while a later pass reads this group from cache (SmolLM2-135M q8, 16 rows:
 * GEMMs 5.0 -> 4.4 ms; Qwen2.5-Coder-1.5B 48.9 -> 46.3 ms; benchmarks/q8_kernel_ab.c). */
QINLINE void QN(q8_groups)(const int SB, const int S, const int BITS, const int HB,
                           const int OFF, const int SC, const int MN, int M, int N,
                           const unsigned char *data, long group_bytes, const q8act_t *a,
                           float al, float be, float *C, int ldc) {
  q8layout_t o = q8_layout((q8fmt_t){SB, S, BITS, HB, OFF, SC, MN});
  int nsb = a->k / SB, groups = (N + Q8_LANES - 1) / Q8_LANES;
  const int rows = S == 32 ? QROWS32 : QROWS16;
  for (int g = 0; g < groups; g++) {
    const unsigned char *ug = data + (long)g * group_bytes;
    int lanes = N - g * Q8_LANES < Q8_LANES ? N - g * Q8_LANES : Q8_LANES;
    for (int l0 = 0; l0 < Q8_LANES; l0 += QL)
      for (int r0 = 0, passes = (M + rows - 1) / rows; r0 < M; r0 += rows) {
        const int lines = passes > 1 ? (o.unit / passes + 63) / 64 : 0;
        const long step = o.unit / passes; /* a pass's share of the next group, per unit */
        const char *pf = (const char *)ug + group_bytes + r0 / rows * nsb * step;
        switch (M - r0 < rows ? M - r0 : rows) {
#define Q8_R(n)                                                                                \
  case n: {                                                                                    \
    QF acc[n];                                                                                 \
    for (int r = 0; r < n; r++) acc[r] = QFZERO();                                             \
    if (passes == 1) /* a constant pf each: the prefetch loops are the compiler's to drop */    \
      for (int sb = 0; sb < nsb; sb++)                                                         \
        QN(q8_unit)(n, SB, S, BITS, HB, OFF, SC, MN, ug + (long)sb * o.unit, o, l0, sb, a, r0,  \
                    acc, Q8_PF);                                                              \
    else                                                                                       \
      for (int sb = 0; sb < nsb; sb++) {                                                       \
        for (int i = 0; Q8_PF && i < lines; i++) _mm_prefetch(pf + sb * step + 64 * i, _MM_HINT_T0); \
        QN(q8_unit)(n, SB, S, BITS, HB, OFF, SC, MN, ug + (long)sb * o.unit, o, l0, sb, a, r0,  \
                    acc, 0);                                                                  \
      }                                                                                        \
    for (int r = 0; r < n; r++) {                                                              \
      float out[QL] __attribute__((aligned(64)));                                              \
      QFSTORE(out, acc[r]);                                                                    \
      for (int l = l0; l < l0 + QL && l < lanes; l++)                                          \
        put(C + (long)(r0 + r) * ldc + g * Q8_LANES + l, out[l - l0], al, be);                \
    }                                                                                          \
    break;                                                                                     \
  }
          Q8_R(1) Q8_R(2) Q8_R(3) Q8_R(4) Q8_R(5) Q8_R(6) Q8_R(7) Q8_R(8)
#undef Q8_R
        }
      }
  }
}

#define Q8_PART(name, ...)                                                                    \
  static QTARGET void QN(q8_part_##name)(int M, int N, const unsigned char *data, long gb,    \
                                         const q8act_t *a, float al, float be, float *C,      \
                                         int ldc) {                                           \
    QN(q8_groups)(__VA_ARGS__, M, N, data, gb, a, al, be, C, ldc);                            \
  }
Q8_PART(q4_0, 32, 32, 4, 0, 8, 0, 0)
Q8_PART(q4_1, 32, 32, 4, 0, 0, 0, 1)
Q8_PART(q5_0, 32, 32, 4, 1, 16, 0, 0)
Q8_PART(q5_1, 32, 32, 4, 1, 0, 0, 1)
Q8_PART(q8_0, 32, 32, 8, 0, 128, 0, 0)
Q8_PART(q2_k, 256, 16, 4, 0, 0, 1, 2)
Q8_PART(q3_k, 256, 16, 4, 0, 4, 1, 0)
Q8_PART(q4_k, 256, 32, 4, 0, 0, 1, 2)
Q8_PART(q5_k, 256, 32, 4, 1, 0, 1, 2)
Q8_PART(q6_k, 256, 16, 4, 2, 32, 1, 0)
#undef Q8_PART

/* M rows (a block) against N outputs of a packed `type` from data on */
static void QN(q8_part_rows)(int type, int M, int N, const unsigned char *data,
                             long group_bytes, const q8act_t *a, float al, float be, float *C,
                             int ldc) {
  switch (type) {
    case T_Q4_0: QN(q8_part_q4_0)(M, N, data, group_bytes, a, al, be, C, ldc); return;
    case T_Q4_1: QN(q8_part_q4_1)(M, N, data, group_bytes, a, al, be, C, ldc); return;
    case T_Q5_0: QN(q8_part_q5_0)(M, N, data, group_bytes, a, al, be, C, ldc); return;
    case T_Q5_1: QN(q8_part_q5_1)(M, N, data, group_bytes, a, al, be, C, ldc); return;
    case T_Q2_K: QN(q8_part_q2_k)(M, N, data, group_bytes, a, al, be, C, ldc); return;
    case T_Q3_K: QN(q8_part_q3_k)(M, N, data, group_bytes, a, al, be, C, ldc); return;
    case T_Q4_K: QN(q8_part_q4_k)(M, N, data, group_bytes, a, al, be, C, ldc); return;
    case T_Q5_K: QN(q8_part_q5_k)(M, N, data, group_bytes, a, al, be, C, ldc); return;
    case T_Q6_K: QN(q8_part_q6_k)(M, N, data, group_bytes, a, al, be, C, ldc); return;
    default: QN(q8_part_q8_0)(M, N, data, group_bytes, a, al, be, C, ldc); return;
  }
}

#undef QINLINE
#undef QN
#undef QTARGET
#undef QI
#undef QF
#undef QL
#undef QROWS32
#undef QROWS16
#undef QDUAL
#undef QLOADI
#undef QAND
#undef QOR
#undef QSRLI16
#undef QSLLI16
#undef QSLLI32
#undef QSET1_8
#undef QSET1_32
#undef QZERO
#undef QADD32
#undef QMUL32
#undef QI8
#undef QU8
#undef QHALF
#undef QFLOAD
#undef QFSTORE
#undef QFSET1
#undef QFZERO
#undef QFMUL
#undef QFMADD
#undef QFNMADD
#undef QCVTF
#undef QDOT_DEF
#undef QPAIRS_DEF
#undef QOFF_IN_DOT
