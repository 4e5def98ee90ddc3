/* AVX512-VNNI integer dot kernels: the bodies of quant_x86.h with vpdpbusd / vpdpwssd
 * (256-bit forms, AVX512VL, with 32 registers) in place of maddubs + madd + add. VNNI is checked at run
 * time apart from the AVX-512 level (ellm_cpu_has_vnni); without it this level uses the
 * AVX2 kernels, which do the same work in one more instruction per step. */
#include <immintrin.h>

#define VNNI_TARGET __attribute__((target("avx512vnni,avx512vl,avx512bw,avx512f")))
#define DOT_US8(u, s) _mm256_dpbusd_epi32(_mm256_setzero_si256(), (u), (s))
#define DOT2_S16(p0, s0, p1, s1) _mm256_dpwssd_epi32(_mm256_madd_epi16((p0), (s0)), (p1), (s1))
#define KINLINE static inline __attribute__((always_inline)) VNNI_TARGET
#define KFUNC static VNNI_TARGET
#define QX_VNNI 1
#define QX_ROWS 4
#define QX_GROUPS 2
#define QX_ZMM 1

#include "quant_x86.h"

ellm_qdot_fn ellm_qdot_avx512(int qtype, int vnni) {
    if (!vnni) return NULL;
    switch (qtype) {
    case ELLM_T_Q4_0: return qdot_q4_0;
    case ELLM_T_Q4_1: return qdot_q4_1;
    case ELLM_T_Q5_0: return qdot_q5_0;
    case ELLM_T_Q5_1: return qdot_q5_1;
    case ELLM_T_Q8_0: return qdot_q8_0;
    case ELLM_T_Q2_K: return qdot_q2_k;
    case ELLM_T_Q3_K: return qdot_q3_k;
    case ELLM_T_Q4_K: return qdot_q4_k;
    case ELLM_T_Q5_K: return qdot_q5_k;
    case ELLM_T_Q6_K: return qdot_q6_k;
    default: return NULL;
    }
}

ellm_qgemm_fn ellm_qgemm_avx512(int qtype, int vnni) {
    if (!vnni) return NULL;
    switch (qtype) {
    case ELLM_T_Q4_0: return qgemm_q4_0;
    case ELLM_T_Q4_1: return qgemm_q4_1;
    case ELLM_T_Q5_0: return qgemm_q5_0;
    case ELLM_T_Q5_1: return qgemm_q5_1;
    case ELLM_T_Q8_0: return qgemm_q8_0;
    case ELLM_T_Q2_K: return qgemm_q2_k;
    case ELLM_T_Q3_K: return qgemm_q3_k;
    case ELLM_T_Q4_K: return qgemm_q4_k;
    case ELLM_T_Q5_K: return qgemm_q5_k;
    case ELLM_T_Q6_K: return qgemm_q6_k;
    default: return NULL;
    }
}

ellm_qdot_fn ellm_qdot_stream_avx512(int qtype, int vnni) {
    if (!vnni) return NULL;
    switch (qtype) {
    case ELLM_T_Q2_K: return qdots_q2_k;
    case ELLM_T_Q3_K: return qdots_q3_k;
    case ELLM_T_Q4_K: return qdots_q4_k;
    case ELLM_T_Q5_K: return qdots_q5_k;
    case ELLM_T_Q6_K: return qdots_q6_k;
    default: return qdot_stream_kernel(qtype);
    }
}
