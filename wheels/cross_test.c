/* Checks the C kernels on a machine this repository's CI does not have: built by
 * wheels/cross.sh with the kernel sources for aarch64 (run under qemu-aarch64) or Windows
 * (MinGW-w64, run under wine64), or for this host.
 *
 * Every SIMD level the CPU offers is checked against the scalar level, which is the
 * reference: on aarch64 the NEON level with each set of its extensions forced in turn
 * (plain, dotprod, dotprod + i8mm), on x86-64 AVX2 / AVX-512 where the CPU has them.
 *   - exact where the contract says so: conversions, top-k, and batch invariance (a
 *     token's linear outputs are the same bits alone, among 20 tokens, on any thread
 *     count);
 *   - a normalized mean squared error bound elsewhere (levels sum floats in other orders).
 * Also the thread pool (counts, nesting, regions) and the file maps.
 *
 *   cross_test [--expect-neon=MASK] [--hashes]
 * MASK: the extensions the CPU must report. --hashes: also print "HASH <type> <level> <hex>",
 * a hash of each level's 20-token linear outputs, so wheels/cross.sh can check that the
 * NEON kernels give the bits of the x86 ones (the same inputs: the generator is seeded).
 * Prints one line per check and, last, "N passed, M failed"; exits 1 on any failure. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "convert.h"
#include "elementwise.h"
#include "mapfile.h"
#include "matmul.h"
#include "quant.h"
#include "sample.h"
#include "simd.h"
#include "threadpool.h"
#include "vision.h"

static int n_pass, n_fail;

static void report(int ok, const char *name, const char *level, const char *detail) {
    if (ok) {
        n_pass++;
        printf("PASSED %s [%s]\n", name, level);
    } else {
        n_fail++;
        printf("FAILED %s [%s]: %s\n", name, level, detail);
    }
}

/* ---------------------------------- helpers ---------------------------------- */

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint32_t next_u32(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng >> 16);
}
static float uniform(float lo, float hi) { return lo + (hi - lo) * (float)(next_u32() & 0xFFFFFF) / 16777216.0f; }

static void *aligned_alloc_64(size_t n) { /* n: a multiple of 64 */
#ifdef _WIN32
    return _aligned_malloc(n, 64);
#else
    return aligned_alloc(64, n);
#endif
}
static void free_64(void *p) {
#ifdef _WIN32
    _aligned_free(p);
#else
    free(p);
#endif
}

static float *rand_floats(int64_t n, float lo, float hi) {
    float *p = malloc((size_t)n * sizeof *p);
    for (int64_t i = 0; i < n; i++) p[i] = uniform(lo, hi);
    return p;
}

/* sum (a - b)^2 / sum b^2; 0 when both are 0; INFINITY on a NaN */
static double nmse(const float *a, const float *b, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = (double)a[i] - (double)b[i];
        num += d * d;
        den += (double)b[i] * b[i];
    }
    if (isnan(num) || isnan(den)) return INFINITY;
    return den > 0 ? num / den : num;
}

static void check_close(const char *name, const char *level, const float *got, const float *ref, int64_t n,
                        double bound) {
    char d[160];
    double e = nmse(got, ref, n);
    snprintf(d, sizeof d, "NMSE %.3g > %.3g", e, bound);
    report(e <= bound, name, level, d);
}

static void check_same(const char *name, const char *level, const void *got, const void *ref, size_t bytes) {
    const unsigned char *g = got, *r = ref;
    size_t i = 0;
    while (i < bytes && g[i] == r[i]) i++;
    char d[160];
    snprintf(d, sizeof d, "differs first at byte %zu of %zu", i, bytes);
    report(i == bytes, name, level, d);
}

/* --------------------------------- levels --------------------------------- */

typedef struct {
    int level, neon;
    char name[48];
} level_cfg;

static int levels(level_cfg *out) {
    int n = 0, best = ellm_simd_best();
    if (best == ELLM_SIMD_NEON) {
        int feats = ellm_neon_features_best();
        const int masks[3] = {0, ELLM_NEON_DOTPROD, ELLM_NEON_DOTPROD | ELLM_NEON_I8MM};
        const char *names[3] = {"neon", "neon+dotprod", "neon+dotprod+i8mm"};
        for (int i = 0; i < 3; i++)
            if ((masks[i] & feats) == masks[i]) {
                out[n] = (level_cfg){ELLM_SIMD_NEON, masks[i], ""};
                snprintf(out[n++].name, sizeof out[0].name, "%s", names[i]);
            }
    } else {
        const int x86[3] = {ELLM_SIMD_AVX2, ELLM_SIMD_AVX512, ELLM_SIMD_AMX};
        for (int i = 0; i < 3; i++)
            if (ellm_simd_set(x86[i]) == 0) {
                out[n] = (level_cfg){x86[i], 0, ""};
                snprintf(out[n++].name, sizeof out[0].name, "%s", ellm_simd_name(x86[i]));
            }
    }
    return n;
}

static void use_level(const level_cfg *c) {
    if (ellm_simd_set(c->level) != 0) abort();
    if (c->level == ELLM_SIMD_NEON && ellm_neon_set_features(c->neon) != 0) abort();
}
static void use_scalar(void) { ellm_simd_set(ELLM_SIMD_SCALAR); }

/* --------------------------------- linear --------------------------------- */

/* Random blocks of qtype whose f16 scale fields hold small finite values (every other
 * byte pattern is a valid weight of these types). */
static void fill_weights(int qtype, uint8_t *w, size_t bytes, int64_t k) {
    for (size_t i = 0; i < bytes; i++) w[i] = (uint8_t)next_u32();
    if (qtype == ELLM_T_F32) {
        float *f = (float *)w;
        for (size_t i = 0; i < bytes / 4; i++) f[i] = uniform(-1, 1);
        return;
    }
    if (qtype == ELLM_T_F16 || qtype == ELLM_T_BF16) {
        uint16_t *h = (uint16_t *)w;
        for (size_t i = 0; i < bytes / 2; i++) {
            float v = uniform(-1, 1);
            h[i] = qtype == ELLM_T_F16 ? ellm_f32_to_f16(v) : ellm_f32_to_bf16(v);
        }
        return;
    }
    int offs[2] = {-1, -1};
    switch (qtype) {
    case ELLM_T_Q4_0: case ELLM_T_Q5_0: case ELLM_T_Q8_0: offs[0] = 0; break;
    case ELLM_T_Q4_1: case ELLM_T_Q5_1: case ELLM_T_Q4_K: case ELLM_T_Q5_K: offs[0] = 0, offs[1] = 2; break;
    case ELLM_T_Q2_K: offs[0] = 80, offs[1] = 82; break;
    case ELLM_T_Q3_K: offs[0] = 108; break;
    case ELLM_T_Q6_K: offs[0] = 208; break;
    default: abort();
    }
    size_t bb = (size_t)ellm_qtype_block_bytes(qtype);
    for (size_t b = 0; b + bb <= bytes; b += bb)
        for (int j = 0; j < 2; j++)
            if (offs[j] >= 0) {
                uint16_t h = ellm_f32_to_f16(uniform(0.001f, 0.02f));
                memcpy(w + b + offs[j], &h, 2);
            }
    (void)k;
}

static void *scratch_for(int qtype, int64_t T, int64_t K, size_t *bytes) {
    *bytes = ellm_linear_scratch_bytes(qtype, T, K);
    size_t n = (*bytes + 63) / 64 * 64;
    return n ? aligned_alloc_64(n) : NULL;
}

static int linear(int qtype, const float *x, int64_t T, int64_t K, const uint8_t *w, size_t wb, int64_t N,
                  float *y) {
    size_t sb;
    void *s = scratch_for(qtype, T, K, &sb);
    int r = ellm_linear(qtype, x, T, K, w, wb, N, NULL, y, s, sb);
    free_64(s);
    return r;
}

static int print_hashes = 0;

/* FNV-1a of the bytes of n floats */
static void print_hash(const char *type, const char *level, const float *y, size_t n) {
    uint64_t h = 1469598103934665603ull;
    const unsigned char *p = (const unsigned char *)y;
    for (size_t i = 0; i < n * sizeof(float); i++) h = (h ^ p[i]) * 1099511628211ull;
    printf("HASH %s %s %016llx\n", type, level, (unsigned long long)h);
}

static void test_linear(const level_cfg *cfg, int n_cfg) {
    static const struct { int qtype; const char *name; } types[] = {
        {ELLM_T_Q4_0, "q4_0"}, {ELLM_T_Q4_1, "q4_1"}, {ELLM_T_Q5_0, "q5_0"}, {ELLM_T_Q5_1, "q5_1"},
        {ELLM_T_Q8_0, "q8_0"}, {ELLM_T_Q2_K, "q2_k"}, {ELLM_T_Q3_K, "q3_k"}, {ELLM_T_Q4_K, "q4_k"},
        {ELLM_T_Q5_K, "q5_k"}, {ELLM_T_Q6_K, "q6_k"}, {ELLM_T_F32, "f32"},   {ELLM_T_F16, "f16"},
        {ELLM_T_BF16, "bf16"},
    };
    const int64_t K = 512, N = 40, T = 20;
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
        const int qt = types[ti].qtype;
        size_t wb = (size_t)(N * ellm_row_bytes(qt, K));
        uint8_t *w = malloc(wb);
        fill_weights(qt, w, wb, K);
        float *x = rand_floats(T * K, -1, 1);
        float *ref = malloc((size_t)(T * N) * sizeof(float)), *y = malloc((size_t)(T * N) * sizeof(float));
        float *y1 = malloc((size_t)(T * N) * sizeof(float));
        char name[64];
        use_scalar();
        int r = linear(qt, x, T, K, w, wb, N, ref);
        snprintf(name, sizeof name, "linear_%s_status", types[ti].name);
        report(r == 0, name, "scalar", ellm_status_str(r));
        for (int c = 0; c < n_cfg; c++) {
            use_level(&cfg[c]);
            linear(qt, x, T, K, w, wb, N, y);
            snprintf(name, sizeof name, "linear_%s_vs_scalar", types[ti].name);
            check_close(name, cfg[c].name, y, ref, T * N, 1e-5);
            if (print_hashes) print_hash(types[ti].name, cfg[c].name, y, (size_t)(T * N));
            /* batch invariance: each token alone, 3 tokens, on one thread */
            for (int64_t t = 0; t < T; t++) linear(qt, x + t * K, 1, K, w, wb, N, y1 + t * N);
            snprintf(name, sizeof name, "linear_%s_T1_equals_T%d", types[ti].name, (int)T);
            check_same(name, cfg[c].name, y1, y, (size_t)(T * N) * sizeof(float));
            linear(qt, x + 5 * K, 3, K, w, wb, N, y1);
            snprintf(name, sizeof name, "linear_%s_T3_equals_T%d", types[ti].name, (int)T);
            check_same(name, cfg[c].name, y1, y + 5 * N, (size_t)(3 * N) * sizeof(float));
            int threads = ellm_num_threads();
            ellm_set_num_threads(1);
            linear(qt, x, T, K, w, wb, N, y1);
            ellm_set_num_threads(threads);
            snprintf(name, sizeof name, "linear_%s_1thread_equals_%dthreads", types[ti].name, threads);
            check_same(name, cfg[c].name, y1, y, (size_t)(T * N) * sizeof(float));
        }
        free(w), free(x), free(ref), free(y), free(y1);
    }
}

/* ------------------------------ row kernels ------------------------------ */

static float from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* f32 -> f16 / bf16 on random values and on the edges (NaN payloads, subnormals of both
 * formats, overflow, rounding ties); f16 / bf16 -> f32 on all 65536 bit patterns. */
static void test_convert(const level_cfg *cfg, int n_cfg) {
    const size_t n = 4096, all = 65536;
    float *x = rand_floats((int64_t)n, -300, 300), *rf = malloc(all * 4), *gf = malloc(all * 4);
    uint16_t *rh = malloc(all * 2), *gh = malloc(all * 2), *every = malloc(all * 2);
    const uint32_t edges[] = {0x7fc00000u, 0x7f800001u, 0xffc12345u, 0x7fbfffffu, 0x7f800000u, 0xff800000u,
                              0x80000000u, 0x00000001u, 0x33800000u, 0x33000001u, 0x387fc000u, 0x38800000u,
                              0x477fe000u, 0x477fefffu, 0x477ff000u, 0x3f808000u, 0x3f818000u, 0x3f800fffu,
                              0x3f801000u, 0x3f803000u, 0x7f7fffffu, 0x00800000u, 0x807fffffu};
    for (size_t i = 0; i < sizeof edges / sizeof edges[0]; i++) x[3 + 7 * i] = from_bits(edges[i]);
    for (size_t i = 0; i < 512; i++) x[1000 + i] = from_bits(0x33000000u + (uint32_t)i * 0x00040001u); /* f16 subnormals */
    for (size_t i = 0; i < all; i++) every[i] = (uint16_t)i;
    for (int c = 0; c < n_cfg; c++) {
        for (int kind = 0; kind < 2; kind++) {
            const char *nm = kind ? "bf16" : "f16";
            char name[64];
            use_scalar();
            if (kind) ellm_f32_to_bf16_row(x, rh, n); else ellm_f32_to_f16_row(x, rh, n);
            use_level(&cfg[c]);
            if (kind) ellm_f32_to_bf16_row(x, gh, n); else ellm_f32_to_f16_row(x, gh, n);
            snprintf(name, sizeof name, "f32_to_%s_row", nm);
            check_same(name, cfg[c].name, gh, rh, n * 2);
            use_scalar();
            if (kind) ellm_bf16_to_f32_row(every, rf, all); else ellm_f16_to_f32_row(every, rf, all);
            use_level(&cfg[c]);
            if (kind) ellm_bf16_to_f32_row(every, gf, all); else ellm_f16_to_f32_row(every, gf, all);
            snprintf(name, sizeof name, "%s_to_f32_row_all_65536", nm);
            check_same(name, cfg[c].name, gf, rf, all * 4);
        }
    }
    free(x), free(rf), free(gf), free(rh), free(gh), free(every);
}

typedef void (*row_op)(const float *x, const float *x2, const float *w, float *out, int64_t rows, int64_t n);

static void op_rmsnorm(const float *x, const float *x2, const float *w, float *o, int64_t r, int64_t n) {
    ellm_rmsnorm(x, n, w, 1e-6f, o, n, r, n);
}
static void op_swiglu(const float *x, const float *x2, const float *w, float *o, int64_t r, int64_t n) {
    ellm_swiglu(x, n, x2, n, o, n, r, n);
}
static void op_geglu(const float *x, const float *x2, const float *w, float *o, int64_t r, int64_t n) {
    ellm_geglu(x, n, x2, n, o, n, r, n);
}
static void op_softcap(const float *x, const float *x2, const float *w, float *o, int64_t r, int64_t n) {
    memcpy(o, x, (size_t)(r * n) * sizeof(float));
    ellm_softcap(o, n, 3.0f, r, n);
}
static void op_exp(const float *x, const float *x2, const float *w, float *o, int64_t r, int64_t n) {
    ellm_exp_row(x, o, r * n);
}
static void op_tanh(const float *x, const float *x2, const float *w, float *o, int64_t r, int64_t n) {
    ellm_tanh_row(x, o, r * n);
}
static void op_layernorm(const float *x, const float *x2, const float *w, float *o, int64_t r, int64_t n) {
    ellm_layernorm(x, n, w, x2, 1e-5f, o, n, r, n);
}
static void op_gelu(const float *x, const float *x2, const float *w, float *o, int64_t r, int64_t n) {
    ellm_gelu_tanh(x, n, o, n, r, n);
}
static void op_attention(const float *x, const float *x2, const float *w, float *o, int64_t r, int64_t n) {
    /* (T = 8 tokens, 2 heads, hd = n / 16) from the first rows of x, x2, w */
    const int64_t T = 8, nh = 2, hd = n / 16;
    ellm_full_attention(x, x2, w, o, T, nh, hd, 4, 0.125f);
    memset(o + T * nh * hd, 0, (size_t)(r * n - T * nh * hd) * sizeof(float));
}

static void test_rows(const level_cfg *cfg, int n_cfg) {
    static const struct { row_op fn; const char *name; } ops[] = {
        {op_rmsnorm, "rmsnorm"}, {op_swiglu, "swiglu"},     {op_geglu, "geglu"},   {op_softcap, "softcap"},
        {op_exp, "exp_row"},     {op_tanh, "tanh_row"},     {op_layernorm, "layernorm"},
        {op_gelu, "gelu_tanh"},  {op_attention, "full_attention"},
    };
    const int64_t rows = 4, n = 1024;
    float *x = rand_floats(rows * n, -4, 4), *x2 = rand_floats(rows * n, -2, 2), *w = rand_floats(rows * n, -1, 1);
    float *ref = malloc((size_t)(rows * n) * 4), *got = malloc((size_t)(rows * n) * 4);
    for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++) {
        use_scalar();
        ops[i].fn(x, x2, w, ref, rows, n);
        for (int c = 0; c < n_cfg; c++) {
            use_level(&cfg[c]);
            ops[i].fn(x, x2, w, got, rows, n);
            check_close(ops[i].name, cfg[c].name, got, ref, rows * n, 1e-9);
        }
    }
    free(x), free(x2), free(w), free(ref), free(got);
}

static void test_sample(const level_cfg *cfg, int n_cfg) {
    const int64_t n = 50000, k = 40;
    float *x = rand_floats(n, -10, 10);
    int32_t ri[4 * 40], gi[4 * 40];
    float rv[4 * 40], gv[4 * 40];
    use_scalar();
    int64_t rn = ellm_topk_f32(x, n, k, ri, rv, 4 * k);
    double rs = ellm_expsum_f32(x, n, 10.0f, 1.0f, -INFINITY);
    int64_t rd = ellm_draw_f32(x, n, 10.0f, 1.0f, -INFINITY, 0.5 * rs);
    for (int c = 0; c < n_cfg; c++) {
        use_level(&cfg[c]);
        int64_t gn = ellm_topk_f32(x, n, k, gi, gv, 4 * k);
        report(gn == rn && !memcmp(gi, ri, (size_t)rn * 4) && !memcmp(gv, rv, (size_t)rn * 4), "topk",
               cfg[c].name, "ids or values differ");
        double gs = ellm_expsum_f32(x, n, 10.0f, 1.0f, -INFINITY);
        char d[96];
        snprintf(d, sizeof d, "%.9g vs %.9g", gs, rs);
        report(fabs(gs - rs) <= 1e-5 * rs, "expsum", cfg[c].name, d);
        int64_t gd = ellm_draw_f32(x, n, 10.0f, 1.0f, -INFINITY, 0.5 * gs);
        snprintf(d, sizeof d, "drew %lld, scalar %lld", (long long)gd, (long long)rd);
        report(llabs(gd - rd) <= 2, "draw", cfg[c].name, d);
    }
    free(x);
}

/* ------------------------------ thread pool ------------------------------ */

typedef struct {
    _Atomic long long sum;
    _Atomic int nested_ok;
} pool_ctx;

static void add_range(void *p, int64_t b, int64_t e, int tid) {
    pool_ctx *c = p;
    long long s = 0;
    for (int64_t i = b; i < e; i++) s += i;
    c->sum += s;
}
static void nested(void *p, int64_t b, int64_t e, int tid) {
    pool_ctx *c = p;
    pool_ctx inner = {0, 0};
    ellm_parallel_for(100, 7, add_range, &inner); /* runs serially on this thread */
    if (inner.sum == 4950 && ellm_in_parallel_region()) c->nested_ok += 1;
}

static void test_pool(void) {
    const char *lv = "pool";
    report(ellm_cpu_count() >= 1, "cpu_count", lv, "no CPU");
    int saved = ellm_num_threads();
    for (int threads = 1; threads <= 8; threads *= 2) {
        ellm_set_num_threads(threads);
        for (int rep = 0; rep < 50; rep++) { /* many jobs back to back: wakes and sleeps */
            pool_ctx c = {0, 0};
            ellm_parallel_for(100000, 1 + rep * 37, add_range, &c);
            if (c.sum != 4999950000LL) {
                report(0, "parallel_for_sum", lv, "wrong sum");
                goto next;
            }
            if (rep == 25) ellm_set_spin_us(0); /* the sleeping path (futex / WaitOnAddress / condvar) */
        }
        report(1, "parallel_for_sum", lv, "");
    next:
        ellm_set_spin_us(200);
        pool_ctx c = {0, 0};
        ellm_parallel_for(64, 1, nested, &c);
        report(c.nested_ok == 64, "parallel_for_nested", lv, "nested call failed");
        c.sum = 0;
        ellm_parallel_for_regions(99999, 13, add_range, &c);
        report(c.sum == 4999850001LL, "parallel_for_regions", lv, "wrong sum");
    }
    ellm_set_num_threads(saved);
}

/* -------------------------------- mapfile -------------------------------- */

static void test_mapfile(const char *dir) {
    const char *lv = "mapfile";
    char path[1024];
    snprintf(path, sizeof path, "%s/ellm_cross_map.bin", dir);
    FILE *f = fopen(path, "wb");
    unsigned char data[70000];
    for (size_t i = 0; i < sizeof data; i++) data[i] = (unsigned char)(i * 7 + 3);
    fwrite(data, 1, sizeof data, f);
    fclose(f);
    ellm_map m;
    int r = ellm_map_open(path, &m);
    report(r == 0 && m.size == sizeof data && !memcmp(m.data, data, sizeof data), "map_file", lv, strerror(r));
    ellm_map_advise_willneed(&m, 1000, 60000);
    ellm_map_close(&m);
    report(m.data == NULL && m.size == 0, "map_close", lv, "not cleared");
    f = fopen(path, "wb");
    fclose(f);
    r = ellm_map_open(path, &m);
    report(r == 0 && m.data == NULL && m.size == 0, "map_empty_file", lv, strerror(r));
    remove(path);
    r = ellm_map_open(path, &m);
    report(r == ENOENT && m.data == NULL, "map_missing_file_is_ENOENT", lv, strerror(r));
    r = ellm_map_open(dir, &m);
    report(r != 0 && m.data == NULL, "map_directory_refused", lv, "mapped a directory");
}

int main(int argc, char **argv) {
    int expect_neon = -1;
    const char *tmp = getenv("TMPDIR");
#ifdef _WIN32
    if (!tmp) tmp = getenv("TEMP");
#endif
    if (!tmp) tmp = "/tmp";
    for (int i = 1; i < argc; i++)
        if (!strncmp(argv[i], "--expect-neon=", 14)) expect_neon = atoi(argv[i] + 14);
        else if (!strcmp(argv[i], "--hashes")) print_hashes = 1;
    printf("SIMD: best %s, NEON extensions %d, %d threads\n", ellm_simd_name(ellm_simd_best()),
           ellm_neon_features_best(), ellm_num_threads());
    if (expect_neon >= 0) {
        char d[96];
        snprintf(d, sizeof d, "detected %d, expected %d", ellm_neon_features_best(), expect_neon);
        report(ellm_simd_best() == ELLM_SIMD_NEON && ellm_neon_features_best() == expect_neon, "neon_detection",
               "detect", d);
    }
    level_cfg cfg[4];
    int n_cfg = levels(cfg);
    test_linear(cfg, n_cfg);
    test_convert(cfg, n_cfg);
    test_rows(cfg, n_cfg);
    test_sample(cfg, n_cfg);
    test_pool();
    test_mapfile(tmp);
    printf("%d passed, %d failed\n", n_pass, n_fail);
    return n_fail ? 1 : 0;
}
