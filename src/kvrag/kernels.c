// Block mode's hot spots on the CPU, loaded by kernels.py; float32 compute, head_dim 64. Compiled with
// cc -O3 -march=native -fopenmp by kernels.build(), which links it against torch's own libgomp: one OpenMP
// runtime, one thread pool, in the process.
//
// fill_block: a cached float16 block converted and rotated into the request's float32 buffers; fill_quantized
// the same for an 8- or 4-bit block, dequantized on the way. Plain C that the compiler vectorizes for the CPU
// it targets: memory-bound loops, built on every x86-64 CPU.
//
// attend, only where the compiler targets AVX-512F: n question tokens attend to `past` cached keys (all
// visible) and to their own n keys (causal). Grouped-query heads are folded into rows, so one kv head serves
// R = group * n rows and row r is question token r % n. Online softmax (flash attention) over tiles of 128
// keys; the scores of 6 rows x 64 keys and the output of 6 rows x 64 dims each stay in 24 registers.
// attend_bf16, where the compiler targets AVX512-BF16: the same with the two products (query . key,
// probability . value) in bfloat16 pairs summed into float32 (vdpbf16ps, twice the float32 rate);
// softmax and sums stay float32.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define D 64   // head_dim
#define H 32   // rotate_half pairs channel i with channel i + 32

// float16 bits to float, exactly (subnormals, infinities and NaN too): the exponent rebased by one multiply by a
// power of two, which every C compiler vectorizes (_Float16 would need GCC 12).
static inline float widen(unsigned short h) {
    union { unsigned u; float f; } v = {(unsigned)(h & 0x7fff) << 13};
    v.f *= 0x1p112f;
    if ((h & 0x7c00) == 0x7c00) v.u |= 0x7f800000u;
    v.u |= (unsigned)(h & 0x8000) << 16;
    return v.f;
}

// One row's keys a (channels 0-31) and b (32-63) rotated by (c, s) per frequency: transformers' rotate_half.
static inline void rotate(const float* restrict a, const float* restrict b, const float* restrict c,
                          const float* restrict s, float* restrict out) {
    for (int i = 0; i < H; i++) {
        out[i] = a[i] * c[i] - b[i] * s[i];
        out[i + H] = b[i] * c[i] + a[i] * s[i];
    }
}

// Writes one cached block into the request's buffers in a single pass: float16 keys rotated by the
// block's position delta (cos/sin per frequency) and float16 values, both converted to float32. k16, v16:
// [groups][n][D] contiguous, one group per (layer, kv head); kout, vout: the same groups, `group_stride`
// floats apart, inside buffers that end `capacity` floats after kout and vout. Returns -1, writing nothing,
// where the block would not fit those buffers (the caller checks shapes too: this is the last line of
// defence for memory).
int fill_block(const unsigned short* k16, const unsigned short* v16, float* kout, float* vout, int groups, int n,
               long group_stride, const float* cos, const float* sin, int threads, long capacity) {
    if (groups <= 0 || n <= 0 || (long)n * D > group_stride || (long)(groups - 1) * group_stride + (long)n * D > capacity)
        return -1;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int g = 0; g < groups; g++) {
        for (int t = 0; t < n; t++) {
            const unsigned short* kr = k16 + ((long)g * n + t) * D;
            const unsigned short* vr = v16 + ((long)g * n + t) * D;
            float* vo = vout + g * group_stride + (long)t * D;
            float a[H], b[H];
            for (int i = 0; i < H; i++) {
                a[i] = widen(kr[i]);
                b[i] = widen(kr[i + H]);
            }
            rotate(a, b, cos, sin, kout + g * group_stride + (long)t * D);
            for (int j = 0; j < D; j++) vo[j] = widen(vr[j]);
        }
    }
    return 0;
}

// fill_block for an 8- or 4-bit block (quant.py): codes dequantized (code * scale + low), keys rotated as above,
// both written as float32. kc, vc: [groups][n][D * bits / 8] codes, 4-bit ones two a byte, channel i in the low
// half and channel i + 32 in the high half of byte i (quant.py's packing: rotate_half's pairs share a byte);
// ks, kl: [groups][D] float16 scale and low end per key channel; vs, vl: [groups][n] per value token. Returns -1,
// writing nothing, where the block would not fit the buffers or `bits` is neither 8 nor 4.
int fill_quantized(const unsigned char* kc, const unsigned short* ks, const unsigned short* kl,
                   const unsigned char* vc, const unsigned short* vs, const unsigned short* vl,
                   float* kout, float* vout, int groups, int n, int bits, long group_stride,
                   const float* cos, const float* sin, int threads, long capacity) {
    if ((bits != 8 && bits != 4) || groups <= 0 || n <= 0 || (long)n * D > group_stride ||
        (long)(groups - 1) * group_stride + (long)n * D > capacity)
        return -1;
    const int width = D * bits / 8;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int g = 0; g < groups; g++) {
        float scale[D], low[D];
        for (int i = 0; i < D; i++) {
            scale[i] = widen(ks[(long)g * D + i]);
            low[i] = widen(kl[(long)g * D + i]);
        }
        for (int t = 0; t < n; t++) {
            const unsigned char* kr = kc + ((long)g * n + t) * width;
            const unsigned char* vr = vc + ((long)g * n + t) * width;
            float* vo = vout + g * group_stride + (long)t * D;
            float vscale = widen(vs[(long)g * n + t]), vlow = widen(vl[(long)g * n + t]);
            float a[H], b[H];
            if (bits == 8) {
                for (int i = 0; i < H; i++) {
                    a[i] = kr[i] * scale[i] + low[i];
                    b[i] = kr[i + H] * scale[i + H] + low[i + H];
                }
                for (int j = 0; j < D; j++) vo[j] = vr[j] * vscale + vlow;
            } else {
                for (int i = 0; i < H; i++) {
                    a[i] = (kr[i] & 15) * scale[i] + low[i];
                    b[i] = (kr[i] >> 4) * scale[i + H] + low[i + H];
                    vo[i] = (vr[i] & 15) * vscale + vlow;
                    vo[i + H] = (vr[i] >> 4) * vscale + vlow;
                }
            }
            rotate(a, b, cos, sin, kout + g * group_stride + (long)t * D);
        }
    }
    return 0;
}

#ifdef __AVX512F__
#include <immintrin.h>

#define T 128  // keys per tile
#define RB 6   // rows per register block

static inline __m512 exp512(__m512 x) {  // 2^(x log2 e): degree-7 Taylor of 2^f on [-0.5, 0.5], truncation < 1e-8
    x = _mm512_max_ps(x, _mm512_set1_ps(-100.f));
    __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.525273e-05f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.540353e-04f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-02f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

// dst[j * ld + i] = src[i * ls + j] for a 16 x 16 block, in registers
static inline void transpose16(const float* src, long ls, float* dst, long ld) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(src + i * ls);
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i + 0] = _mm512_shuffle_ps(t[4 * i + 0], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i + 0], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 4; j++) {
            t[8 * i + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + 4 + j], 0x88);
            t[8 * i + 4 + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + 4 + j], 0xdd);
        }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
        r[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xdd);
    }
    for (int i = 0; i < 16; i++) _mm512_storeu_ps(dst + i * ld, r[i]);
}

// acc[0:4] += b * x[0:4]: one row of a register block, 64 floats wide
static inline void fma_row(__m512 acc[4], __m512 b, __m512 x0, __m512 x1, __m512 x2, __m512 x3) {
    acc[0] = _mm512_fmadd_ps(b, x0, acc[0]);
    acc[1] = _mm512_fmadd_ps(b, x1, acc[1]);
    acc[2] = _mm512_fmadd_ps(b, x2, acc[2]);
    acc[3] = _mm512_fmadd_ps(b, x3, acc[3]);
}

// s[RB][T] = scale * q[RB][D] . kt[D][T]
static inline void scores(const float* q, const float* kt, float* s, float scale) {
    __m512 acc[RB][4];
    for (int r = 0; r < RB; r++) for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
    for (int d = 0; d < D; d++) {
        __m512 k0 = _mm512_load_ps(kt + d * T), k1 = _mm512_load_ps(kt + d * T + 16);
        __m512 k2 = _mm512_load_ps(kt + d * T + 32), k3 = _mm512_load_ps(kt + d * T + 48);
        for (int r = 0; r < RB; r++) fma_row(acc[r], _mm512_set1_ps(q[r * D + d]), k0, k1, k2, k3);
    }
    __m512 sc = _mm512_set1_ps(scale);
    for (int r = 0; r < RB; r++)
        for (int j = 0; j < 4; j++) _mm512_store_ps(s + r * T + j * 16, _mm512_mul_ps(acc[r][j], sc));
}

// o[RB][D] += p[RB][:nt] . v[:nt][D]
static inline void values(const float* p, const float* v, int nt, float* o) {
    __m512 acc[RB][4];
    for (int r = 0; r < RB; r++) for (int j = 0; j < 4; j++) acc[r][j] = _mm512_load_ps(o + r * D + j * 16);
    for (int t = 0; t < nt; t++) {
        const float* vr = v + t * D;
        __m512 v0 = _mm512_loadu_ps(vr), v1 = _mm512_loadu_ps(vr + 16);
        __m512 v2 = _mm512_loadu_ps(vr + 32), v3 = _mm512_loadu_ps(vr + 48);
        for (int r = 0; r < RB; r++) fma_row(acc[r], _mm512_set1_ps(p[r * T + t]), v0, v1, v2, v3);
    }
    for (int r = 0; r < RB; r++) for (int j = 0; j < 4; j++) _mm512_store_ps(o + r * D + j * 16, acc[r][j]);
}

#ifdef __AVX512BF16__
typedef unsigned int pair;  // two bfloat16s, multiplied with another pair and summed by vdpbf16ps

// out[j] = (a[j], b[j]) for j < n, a multiple of 16
static inline void pack_pairs(const float* a, const float* b, pair* out, int n) {
    static const short order[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                    8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    __m512i interleave = _mm512_loadu_si512(order);
    for (int j = 0; j < n; j += 16) {
        __m512i ab = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(b + j), _mm512_loadu_ps(a + j));
        _mm512_storeu_si512(out + j, _mm512_permutexvar_epi16(interleave, ab));
    }
}

// out[j] = (x[2j], x[2j + 1]) for j < n / 2, n a multiple of 32; out may be x itself
static inline void pack_neighbours(const float* x, pair* out, int n) {
    for (int j = 0; j < n; j += 32)
        _mm512_storeu_si512(out + j / 2, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + j + 16), _mm512_loadu_ps(x + j)));
}

// acc[0:4] += b . x[0:4], pairwise
static inline void dot_row(__m512 acc[4], __m512i b, __m512i x0, __m512i x1, __m512i x2, __m512i x3) {
    acc[0] = _mm512_dpbf16_ps(acc[0], (__m512bh)b, (__m512bh)x0);
    acc[1] = _mm512_dpbf16_ps(acc[1], (__m512bh)b, (__m512bh)x1);
    acc[2] = _mm512_dpbf16_ps(acc[2], (__m512bh)b, (__m512bh)x2);
    acc[3] = _mm512_dpbf16_ps(acc[3], (__m512bh)b, (__m512bh)x3);
}

// s[RB][T] = scale * q[RB][D/2] . kt[D/2][T]: dims in pairs
static inline void scores_bf16(const pair* q, const pair* kt, float* s, float scale) {
    __m512 acc[RB][4];
    for (int r = 0; r < RB; r++) for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
    for (int d = 0; d < D / 2; d++) {
        __m512i k0 = _mm512_load_si512(kt + d * T), k1 = _mm512_load_si512(kt + d * T + 16);
        __m512i k2 = _mm512_load_si512(kt + d * T + 32), k3 = _mm512_load_si512(kt + d * T + 48);
        for (int r = 0; r < RB; r++) dot_row(acc[r], _mm512_set1_epi32(q[r * D / 2 + d]), k0, k1, k2, k3);
    }
    __m512 sc = _mm512_set1_ps(scale);
    for (int r = 0; r < RB; r++)
        for (int j = 0; j < 4; j++) _mm512_store_ps(s + r * T + j * 16, _mm512_mul_ps(acc[r][j], sc));
}

// o[RB][D] += p[RB][np] . v[np][D]: keys in pairs, p's rows T pairs apart (packed over the scores)
static inline void values_bf16(const pair* p, const pair* v, int np, float* o) {
    __m512 acc[RB][4];
    for (int r = 0; r < RB; r++) for (int j = 0; j < 4; j++) acc[r][j] = _mm512_load_ps(o + r * D + j * 16);
    for (int t = 0; t < np; t++) {
        const pair* vr = v + t * D;
        __m512i v0 = _mm512_load_si512(vr), v1 = _mm512_load_si512(vr + 16);
        __m512i v2 = _mm512_load_si512(vr + 32), v3 = _mm512_load_si512(vr + 48);
        for (int r = 0; r < RB; r++) dot_row(acc[r], _mm512_set1_epi32(p[r * T + t]), v0, v1, v2, v3);
    }
    for (int r = 0; r < RB; r++) for (int j = 0; j < 4; j++) _mm512_store_ps(o + r * D + j * 16, acc[r][j]);
}
#endif

// Keys [nt][D] of one tile transposed into kt [D][T], zero past nt: kept in the first-level cache
// for the score kernel, which broadcasts queries against 64 keys at a time.
static void transpose_tile(const float* k, int nt, float* kt) {
    if (nt == T) {
        for (int tb = 0; tb < T; tb += 16)
            for (int db = 0; db < D; db += 16) transpose16(k + tb * D + db, D, kt + db * T + tb, T);
    } else {
        for (int t = 0; t < T; t++)
            for (int d = 0; d < D; d++) kt[d * T + t] = t < nt ? k[t * D + d] : 0.f;
    }
}

// q: [heads][rows][D], rows a multiple of RB (padding rows are computed and ignored).
// k, v: [heads] of [past + n][D], heads `head_stride` floats apart. out: [heads][rows][D].
// Each kv head's rows are split into `threads` tasks, so that every thread gets a share of every
// head; each task transposes the keys a tile at a time as it goes. With `bf16` (a constant: the
// compiler makes one function per value) the task also packs the tile into bfloat16 pairs: the
// keys' dims, the values' keys, and the probabilities' keys, over the scores.
static inline __attribute__((always_inline)) void attend_tiles(
    const float* q, const float* k, const float* v, float* out, int heads, int rows, int n, int past,
    long head_stride, float scale, int threads, const int bf16) {
    int L = past + n, tiles = (L + T - 1) / T, tasks_per_head = threads;
    int blocks = rows / RB, per = (blocks + tasks_per_head - 1) / tasks_per_head;
    #pragma omp parallel num_threads(threads)
    {
        float* kt = aligned_alloc(64, sizeof(float) * D * T);
        float* s = aligned_alloc(64, sizeof(float) * per * RB * T);
        float* o = aligned_alloc(64, sizeof(float) * per * RB * D);
        float* m = malloc(sizeof(float) * per * RB);
        float* l = malloc(sizeof(float) * per * RB);
#ifdef __AVX512BF16__
        static const float zeros[D];
        pair* kt2 = bf16 ? aligned_alloc(64, sizeof(pair) * D / 2 * T) : NULL;
        pair* v2 = bf16 ? aligned_alloc(64, sizeof(pair) * T / 2 * D) : NULL;
        pair* q2 = bf16 ? aligned_alloc(64, sizeof(pair) * per * RB * D / 2) : NULL;
#endif
        #pragma omp for schedule(static)
        for (int task = 0; task < heads * tasks_per_head; task++) {
            int h = task / tasks_per_head, b0 = (task % tasks_per_head) * per;
            int b1 = b0 + per < blocks ? b0 + per : blocks;
            int r0 = b0 * RB, nr = (b1 - b0) * RB;
            if (nr <= 0) continue;
            const float* qh = q + ((long)h * rows + r0) * D;
#ifdef __AVX512BF16__
            if (bf16) pack_neighbours(qh, q2, nr * D);
#endif
            memset(o, 0, sizeof(float) * nr * D);
            for (int r = 0; r < nr; r++) { m[r] = -INFINITY; l[r] = 0.f; }
            for (int tile = 0; tile < tiles; tile++) {
                int t0 = tile * T, nt = L - t0 < T ? L - t0 : T;
                const float* vt = v + h * head_stride + (long)t0 * D;
                transpose_tile(k + h * head_stride + (long)t0 * D, nt, kt);
#ifdef __AVX512BF16__
                if (bf16) {
                    for (int d = 0; d < D; d += 2) pack_pairs(kt + d * T, kt + (d + 1) * T, kt2 + d / 2 * T, T);
                    for (int t = 0; t < nt; t += 2)  // a key past the tile pairs with zeros
                        pack_pairs(vt + t * D, t + 1 < nt ? vt + (t + 1) * D : zeros, v2 + t / 2 * D, D);
                }
#endif
                for (int b = 0; b < nr; b += RB)
                    for (int half = 0; half < T; half += 64) {
#ifdef __AVX512BF16__
                        if (bf16) { scores_bf16(q2 + b * D / 2, kt2 + half, s + b * T + half, scale); continue; }
#endif
                        scores(qh + b * D, kt + half, s + b * T + half, scale);
                    }
                int masked = t0 + T > past;  // the tile reaches the question's own keys or the end
                for (int r = 0; r < nr; r++) {
                    float* sr = s + r * T;
                    if (masked) {
                        int i = (r0 + r) % n;
                        for (int t = 0; t < T; t++) {
                            int key = t0 + t;
                            if (key >= L || (key >= past && key - past > i)) sr[t] = -INFINITY;
                        }
                    }
                    __m512 mx = _mm512_load_ps(sr);
                    for (int j = 16; j < T; j += 16) mx = _mm512_max_ps(mx, _mm512_load_ps(sr + j));
                    float tile_max = _mm512_reduce_max_ps(mx), m_new = tile_max > m[r] ? tile_max : m[r];
                    float alpha = m[r] == -INFINITY ? 0.f : expf(m[r] - m_new);
                    __m512 mn = _mm512_set1_ps(m_new), sum = _mm512_setzero_ps(), neg_inf = _mm512_set1_ps(-INFINITY);
                    for (int j = 0; j < T; j += 16) {
                        __m512 x = _mm512_load_ps(sr + j), e = exp512(_mm512_sub_ps(x, mn));
                        if (masked) e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, neg_inf, _CMP_NEQ_OQ), e);
                        _mm512_store_ps(sr + j, e);
                        sum = _mm512_add_ps(sum, e);
                    }
#ifdef __AVX512BF16__
                    if (bf16) pack_neighbours(sr, (pair*)sr, T);
#endif
                    l[r] = l[r] * alpha + _mm512_reduce_add_ps(sum);
                    m[r] = m_new;
                    if (alpha != 1.f) {
                        __m512 a = _mm512_set1_ps(alpha);
                        for (int j = 0; j < D; j += 16)
                            _mm512_store_ps(o + r * D + j, _mm512_mul_ps(_mm512_load_ps(o + r * D + j), a));
                    }
                }
                for (int b = 0; b < nr; b += RB) {
#ifdef __AVX512BF16__
                    if (bf16) { values_bf16((pair*)(s + b * T), v2, (nt + 1) / 2, o + b * D); continue; }
#endif
                    values(s + b * T, vt, nt, o + b * D);
                }
            }
            float* oh = out + ((long)h * rows + r0) * D;
            for (int r = 0; r < nr; r++) {
                __m512 inv = _mm512_set1_ps(1.f / l[r]);
                for (int j = 0; j < D; j += 16)
                    _mm512_storeu_ps(oh + r * D + j, _mm512_mul_ps(_mm512_load_ps(o + r * D + j), inv));
            }
        }
        free(kt); free(s); free(o); free(m); free(l);
#ifdef __AVX512BF16__
        free(kt2); free(v2); free(q2);
#endif
    }
}

void attend(const float* q, const float* k, const float* v, float* out, int heads, int rows, int n, int past,
            long head_stride, float scale, int threads) {
    attend_tiles(q, k, v, out, heads, rows, n, past, head_stride, scale, threads, 0);
}

#ifdef __AVX512BF16__
void attend_bf16(const float* q, const float* k, const float* v, float* out, int heads, int rows, int n, int past,
                 long head_stride, float scale, int threads) {
    attend_tiles(q, k, v, out, heads, rows, n, past, head_stride, scale, threads, 1);
}
#endif
#endif  // __AVX512F__
