# Declarations of the csrc/ headers that several shims call (cimported; no code of its own).
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t


cdef extern from "matmul.h":
    size_t ellm_linear_scratch_bytes(int qtype, int64_t T, int64_t K) nogil
    int ellm_linear(int qtype, const float *x, int64_t T, int64_t K, const uint8_t *w,
                    size_t w_bytes, int64_t N, const float *bias, float *y, void *scratch,
                    size_t scratch_bytes) nogil
    ctypedef struct ellm_linear_part:
        int qtype
        const uint8_t *w
        size_t w_bytes
        int64_t N
        float *y
        int64_t ldy
        const float *bias
    enum:
        ELLM_LINEAR_MAX_PARTS
    size_t ellm_linear_multi_scratch_bytes(const ellm_linear_part *parts, int n_parts, int64_t T,
                                           int64_t K) nogil
    int ellm_linear_multi(const float *x, int64_t T, int64_t K, const ellm_linear_part *parts,
                          int n_parts, void *scratch, size_t scratch_bytes) nogil


cdef extern from "elementwise.h":
    void ellm_rmsnorm(const float *x, int64_t ldx, const float *w, float eps, float *out, int64_t ldo,
                      int64_t rows, int64_t n) nogil
    void ellm_add_rmsnorm(float *residual, int64_t ldr, const float *x, int64_t ldx, const float *w,
                          float eps, float *out, int64_t ldo, int64_t rows, int64_t n) nogil
    void ellm_swiglu(const float *gate, int64_t ldg, const float *up, int64_t ldu, float *out,
                     int64_t ldo, int64_t rows, int64_t n) nogil
    void ellm_geglu(const float *gate, int64_t ldg, const float *up, int64_t ldu, float *out,
                    int64_t ldo, int64_t rows, int64_t n) nogil
    void ellm_add(float *a, int64_t lda, const float *b, int64_t ldb, int64_t rows, int64_t n) nogil
    void ellm_scale(float *x, int64_t ldx, float s, int64_t rows, int64_t n) nogil
    void ellm_softcap(float *x, int64_t ldx, float cap, int64_t rows, int64_t n) nogil
    void ellm_exp_row(const float *x, float *out, int64_t n) nogil
    void ellm_tanh_row(const float *x, float *out, int64_t n) nogil


cdef extern from "attention.h":
    ctypedef struct ellm_attn_args:
        const float *q
        const float *k
        const float *v
        int64_t q_stride, k_stride, v_stride
        const int32_t *positions
        const int32_t *seq_ids
        const int32_t *key_limit
        const int32_t *block_tables
        float *k_cache
        float *v_cache
        const float *inv_freq
        float *out
        int64_t T, B, max_blocks, num_blocks
        int32_t nh, nkv, hd, block_size
        int32_t n_rot, interleaved, window
        float scale, softcap, rope_mscale
        uint16_t *k_cache16
        uint16_t *v_cache16
    int64_t ellm_rope_attention_scratch_floats(int64_t T, int32_t nh, int32_t nkv, int32_t hd,
                                               int threads) nogil
    int64_t ellm_rope_attention_scratch_wanted(const ellm_attn_args *a, int threads) nogil
    int ellm_rope_attention(const ellm_attn_args *a, float *scratch, int64_t scratch_floats,
                            char *err, size_t err_len) nogil
