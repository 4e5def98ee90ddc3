/* GGML weight formats: block layouts, dequantization to f32, and quantization of f32
 * rows to Q8_0 / Q4_0. No Python here; callers pass every buffer and its size.
 *
 * Type ids are GGML's (as in src/ellm/formats/ggml_types.py). Quantized tensors are
 * rows of K elements, each row a run of fixed-size blocks (32 or 256 elements). */
#ifndef ELLM_QUANT_H
#define ELLM_QUANT_H
#include <stddef.h>
#include <stdint.h>

enum ellm_qtype {
    ELLM_T_F32 = 0,
    ELLM_T_F16 = 1,
    ELLM_T_Q4_0 = 2,
    ELLM_T_Q4_1 = 3,
    ELLM_T_Q5_0 = 6,
    ELLM_T_Q5_1 = 7,
    ELLM_T_Q8_0 = 8,
    ELLM_T_Q2_K = 10,
    ELLM_T_Q3_K = 11,
    ELLM_T_Q4_K = 12,
    ELLM_T_Q5_K = 13,
    ELLM_T_Q6_K = 14,
    ELLM_T_BF16 = 30,
};

/* Status codes returned by every checked entry point (quant.h and matmul.h). */
enum ellm_status {
    ELLM_OK = 0,
    ELLM_E_TYPE = -1,    /* type id not supported by this function */
    ELLM_E_SHAPE = -2,   /* element count is not whole blocks, or a size is negative */
    ELLM_E_SIZE = -3,    /* byte length disagrees with the element count */
    ELLM_E_SCRATCH = -4, /* scratch buffer too small or misaligned */
    ELLM_E_INDEX = -5,   /* a row index is out of range */
};

/* A one-line description of a status code (static storage). */
const char *ellm_status_str(int status);

/* Elements per block (1 for float types); 0 when the type is not supported. */
int64_t ellm_qtype_block_elems(int qtype);
/* Bytes per block; 0 when the type is not supported. */
int64_t ellm_qtype_block_bytes(int qtype);
/* Bytes of one row of n elements; -1 for an unsupported type, negative n, or n that
 * is not a whole number of blocks. */
int64_t ellm_row_bytes(int qtype, int64_t n);

/* (src_bytes,) blocks -> (n,) f32. src_bytes must equal ellm_row_bytes(qtype, n). */
int ellm_dequantize(int qtype, const uint8_t *src, size_t src_bytes, float *dst, int64_t n);

/* Rows `ids` of a (n_rows, k) weight matrix stored as n_rows rows of row_bytes each
 * -> (n_ids, k) f32. Every id is checked against n_rows before anything is written. */
int ellm_get_rows(int qtype, const uint8_t *w, size_t w_bytes, int64_t n_rows, int64_t k,
                  const int32_t *ids, int64_t n_ids, float *out);

/* (n_rows, k) f32 -> (n_rows, row_bytes) blocks, for qtype Q8_0 or Q4_0. The rounding
 * matches GGML's reference quantizers, so the bytes equal llama.cpp's. */
int ellm_quantize_rows(int qtype, const float *src, int64_t n_rows, int64_t k, uint8_t *dst,
                       size_t dst_bytes);

/* (n_rows, ellm_row_bytes(qtype, k)) GGML Q4_K, Q5_K or Q6_K rows -> (n_rows, dst_stride)
 * rows as the GPU keeps them (src/ellm/ops/cuda_kernels.py rows_split; csrc/cuda/common.cuh
 * deq8_q4_k, deq8_q5_k, deq8_q6_k), the rest of each row zero. Q4_K: each step of 32
 * weights 16 bytes of nibbles, then the blocks' heads (d, dmin, the scales and mins
 * unpacked to 6 bits each: a word of their top 2 bits, a byte a sub-block of the low 4).
 * Q5_K: each step 16 bytes of nibbles and 4 of fifth bits, then the heads. Q6_K: each step a 24-byte
 * record (16 bytes of nibbles, then 8 of high bits), then the blocks' int8 scales, then
 * their f16 d. */
int ellm_split_rows(int qtype, const uint8_t *src, size_t src_bytes, int64_t n_rows, int64_t k,
                    uint8_t *dst, size_t dst_bytes, int64_t dst_stride);

#endif
