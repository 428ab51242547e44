/* The AVX-512 VNNI instantiation of the q8 vector kernel: a 64-byte vector is a whole group's
 * 16 lanes. Included by q8.h with QN(name) defined (the functions' suffix); Q8_KERNEL names
 * the kernel file (default q8_kernel.h; benchmarks/q8_kernel_ab.c points it at another). */
#define QTARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))
#define QI __m512i
#define QF __m512
#define QL 16
#define QROWS32 8 /* rows a pass over 32-weight sub-blocks (8 weight vectors), and 16-weight */
#define QROWS16 8
#define QDUAL 4 /* up to this many rows a pass, two dependency chains a row */
#define QLOADI(p) _mm512_loadu_si512(p)
#define QAND(a, b) _mm512_and_si512(a, b)
#define QOR(a, b) _mm512_or_si512(a, b)
#define QSRLI16(v, n) _mm512_srli_epi16(v, n)
#define QSLLI16(v, n) _mm512_slli_epi16(v, n)
#define QSLLI32(v, n) _mm512_slli_epi32(v, n)
#define QSET1_8(c) _mm512_set1_epi8(c)
#define QSET1_32(x) _mm512_set1_epi32(x)
#define QZERO() _mm512_setzero_si512()
#define QADD32(a, b) _mm512_add_epi32(a, b)
#define QMUL32(a, b) _mm512_mullo_epi32(a, b)
#define QI8(p) _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define QU8(p) _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define QHALF(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define QFLOAD(p) _mm512_load_ps(p)
#define QFSTORE(p, v) _mm512_store_ps(p, v)
#define QFSET1(x) _mm512_set1_ps(x)
#define QFZERO() _mm512_setzero_ps()
#define QFMUL(a, b) _mm512_mul_ps(a, b)
#define QFMADD(a, b, c) _mm512_fmadd_ps(a, b, c)
#define QFNMADD(a, b, c) _mm512_fnmadd_ps(a, b, c)
#define QCVTF(v) _mm512_cvtepi32_ps(v)
/* acc + the 4-byte dot products of w's unsigned bytes with the signed bytes at p, broadcast
 * (a memory operand: the compiler would spend a broadcast instruction on each) */
#define QDOT_DEF                                                                                \
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int *)p));          \
  return acc;
/* acc + w's pairs of signed 16-bit halves times the pair at p, broadcast */
#define QPAIRS_DEF                                                                              \
  __asm__("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int *)p));          \
  return acc;
#define QOFF_IN_DOT 0
#ifndef Q8_KERNEL
#define Q8_KERNEL "q8_kernel.h"
#endif
#include Q8_KERNEL
#undef Q8_KERNEL
