// The reference check (kernels/reference.py) compiled: one pass over each operand and one over C,
// reading each in its own dtype and accumulating in float64, then the thresholds and the verdict.
// The arithmetic is reference.py's torch check (its oracle, ``check_torch``), term for term; only
// the order of additions differs. No torch headers: built with plain g++ in a second or two and
// called through ctypes with raw pointers (kernels/compiled.py).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#ifdef ABFT_PROFILE
#include <cstdio>
#define STAGE(name) prof(name)
#else
#define STAGE(name)
#endif
#ifdef _OPENMP
#include <omp.h>
#endif
#if (defined(__AVX__) && defined(__F16C__)) || (defined(__AVX512F__) && defined(__AVX512CD__))
#include <immintrin.h>
#endif

typedef int64_t i64;

// The order of threshold.Coefficients' fields, as compiled.py packs them (checked at load).
extern "C" const char* abft_coef_names() {
    return "lam,k,bs,p_s2,p_q,p_d2,c_p2,c_qs,c_s12,c_s2,c_q,bias,lowent,directed,directed_chk,"
           "eta_log2,eta_absolute,out,out_add,eta_acc,chk_parts,eta_out,ftz,w_t,w_sa,w_da,w_scale,cap,rep";
}
enum { LAM, KK, BS, P_S2, P_Q, P_D2, C_P2, C_QS, C_S12, C_S2, C_Q, BIAS, LOWENT, DIRECTED,
       DIRECTED_CHK, ETA_LOG2, ETA_ABSOLUTE, OUT, OUT_ADD, ETA_ACC, CHK_PARTS, ETA_OUT, FTZ, W_T, W_SA,
       W_DA, W_SCALE, CAP, REP, NCOEF };

enum { DT_F32 = 0, DT_F64 = 1, DT_BF16 = 2, DT_F16 = 3 };
static const double NaN = std::numeric_limits<double>::quiet_NaN();
static const double INF = std::numeric_limits<double>::infinity();
static const double DMAX = std::numeric_limits<double>::max();
static const double FLOOR = 7.888609052210118e-31;      // threshold.FLOOR = 2^-100

struct bf16_t { uint16_t v; };
struct f16_t { uint16_t v; };

static inline double cvt(float x) { return x; }
static inline double cvt(double x) { return x; }
static inline double cvt(bf16_t x) {
    uint32_t u = (uint32_t)x.v << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
#if defined(__AVX__) && defined(__F16C__)
static inline double cvt(f16_t x) { return _cvtsh_ss(x.v); }     // exact, as below
#else
static inline double cvt(f16_t x) {
    uint32_t h = x.v, sign = (h & 0x8000u) << 16, ex = (h >> 10) & 0x1f, man = h & 0x3ff;
    if (ex == 0x1f) {                                     // inf, NaN
        uint32_t u = sign | 0x7f800000u | (man << 13);
        float f;
        std::memcpy(&f, &u, 4);
        return f;
    }
    double v = ex ? std::ldexp((double)(man | 0x400), (int)ex - 25) : std::ldexp((double)man, -24);
    return sign ? -v : v;
}
#endif

// NaN-propagating max (torch's amax; the minimum is nmin4, four wide)
static inline double nmax(double a, double b) { return (a != a || b != b) ? NaN : (a > b ? a : b); }
static inline bool fin(double v) { return v - v == 0; }
// v^2 clamped to the largest double (a corrupted value's square may overflow)
static inline double sq_capped(double v) { double vv = v * v; return vv > DMAX ? DMAX : vv; }

// stats.exponents: amax = m 2^e, m in [0.5, 1), from the bits; clamped to +-1000
static inline double expo(double amax) {
    if (!(amax > 0) || !fin(amax)) return 0.0;
    uint64_t u;
    std::memcpy(&u, &amax, 8);
    double e = (double)((i64)((u >> 52) & 0x7ff) - 1022);
    return std::min(1000.0, std::max(-1000.0, e));
}

// 2^e for e holding an integer (exact; 0 or inf beyond the range, as exp2)
static inline double pow2(double e) {
    if (e >= -1022 && e <= 1023) {                 // the normal range: the bits directly
        uint64_t u = (uint64_t)((i64)e + 1023) << 52;
        double r;
        std::memcpy(&r, &u, 8);
        return r;
    }
    return std::ldexp(1.0, (int)std::max(-4000.0, std::min(4000.0, e)));
}

// 2^x as 2^min(x, POW2_SPLIT) times 2^(x - min(x, POW2_SPLIT)) (threshold.pow2_factors): 2^x
// alone overflows past 2^1023 where a value it scales does not; v * hi * lo is v 2^x exactly
constexpr double POW2_SPLIT = 1000.0;
static inline double pow2_hi(double x) { return pow2(std::min(x, POW2_SPLIT)); }
static inline double pow2_lo(double x) { return pow2(x - std::min(x, POW2_SPLIT)); }

static int threads_for(int nt, double work) { return work < 3e4 ? 1 : nt; }

#ifdef ABFT_PROFILE
// -DABFT_PROFILE: each stage's mean time since the previous stage, on stderr every
// ABFT_PROFILE_EVERY checks (default 1000) and at the first (printing inside the timed path would
// be timed)
#ifndef ABFT_PROFILE_EVERY
#define ABFT_PROFILE_EVERY 1000
#endif
static void prof(const char* name) {
#ifdef _OPENMP
    if (omp_in_parallel()) return;     // stages inside a batch's region (check_batches): not timed
#endif
    static double last = 0, sums[16] = {0};
    static const char* names[16];
    static int stage = 0, calls = 0, since = 0;
    double now = omp_get_wtime();
    if (name[0] == '>') {
        stage = 0;
    } else if (stage < 16) {
        names[stage] = name;
        sums[stage++] += now - last;
    }
    if (name[0] == '.') since++;
    if (name[0] == '.' && (++calls == 1 || calls % ABFT_PROFILE_EVERY == 0)) {
        const int n = since;             // the calls summed since the last print
        since = 0;
        for (int i = 0; i < stage; i++) {
            fprintf(stderr, "%s %.4f ms  ", names[i], sums[i] / n * 1e3);
            sums[i] = 0;
        }
        fprintf(stderr, "\n");
    }
    last = omp_get_wtime();
}
#endif

// Reductions in N (a power of two, at least 4) independent accumulators, combined in a fixed
// order: halves added until four remain, then (0 + 2) + (1 + 3).
constexpr int LANES = 16;
template <int N = LANES>
static inline double lanes_sum(const double* l) {
    double h[N / 2];
    for (int i = 0; i < N / 2; i++) h[i] = l[i] + l[i + N / 2];
    for (int n = N / 4; n >= 4; n /= 2)
        for (int i = 0; i < n; i++) h[i] += h[i + n];
    return (h[0] + h[2]) + (h[1] + h[3]);
}
template <int N = LANES>
static inline double lanes_max(const double* l) {
    double m = l[0];
    for (int i = 1; i < N; i++) m = l[i] > m ? l[i] : m;
    return m;
}

// Four consecutive elements as float64 lanes (GCC vector extensions: SSE2 pairs where the target
// has no AVX; the AVX conversions where it has)
typedef double v4d __attribute__((vector_size(32)));
static inline v4d splat(double x) { return (v4d){x, x, x, x}; }
typedef double v4d_u __attribute__((vector_size(32), aligned(8)));
typedef long long v4i __attribute__((vector_size(32)));
static inline v4d abs4(v4d x) { return (v4d)((v4i)x & ~(v4i)splat(-0.0)); }
static inline v4d load4(const double* p) { return *(const v4d_u*)p; }
static inline void store4(double* p, v4d x) { *(v4d_u*)p = x; }
template <typename T>
static inline v4d load4(const T* p) { return (v4d){cvt(p[0]), cvt(p[1]), cvt(p[2]), cvt(p[3])}; }
#if defined(__AVX__) && defined(__F16C__)
static inline v4d load4(const float* p) { return (v4d)_mm256_cvtps_pd(_mm_loadu_ps(p)); }
static inline v4d load4(const bf16_t* p) {
    __m128i h = _mm_loadl_epi64((const __m128i*)p);
    return (v4d)_mm256_cvtps_pd(_mm_castsi128_ps(_mm_unpacklo_epi16(_mm_setzero_si128(), h)));
}
static inline v4d load4(const f16_t* p) {
    return (v4d)_mm256_cvtps_pd(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)p)));
}
#endif

// Eight consecutive elements as float64 lanes, one AVX-512 register, for the multiply-add loops
// (thin_tile, rows_tile): vectorised across outputs, so their width changes no value (but the
// sign of a NaN where two NaNs meet in a multiply-add: GCC orders its operands per width). A Xeon
// core here runs two 512-bit multiply-adds a cycle, as many as 256-bit ones (60 against 33 GFMA/s
// a core in a register-only loop); Zen 4 splits a 512-bit operation in two. The passes that add
// along a row (load_sums) gained nothing from them and keep four-lane vectors.
#if defined(__AVX512F__) && defined(__F16C__)
#define ABFT_V8 1
typedef double v8d __attribute__((vector_size(64)));
typedef double v8d_u __attribute__((vector_size(64), aligned(8)));
typedef long long v8i __attribute__((vector_size(64)));
static inline v8d splat8(double x) { return (v8d){x, x, x, x, x, x, x, x}; }
static inline v8d abs8(v8d x) { return (v8d)((v8i)x & ~(v8i)splat8(-0.0)); }
static inline v8d load8(const double* p) { return *(const v8d_u*)p; }
static inline void store8(double* p, v8d x) { *(v8d_u*)p = x; }
static inline v8d load8(const float* p) { return (v8d)_mm512_cvtps_pd(_mm256_loadu_ps(p)); }
static inline v8d load8(const bf16_t* p) {
    __m128i h = _mm_loadu_si128((const __m128i*)p);
    return (v8d)_mm512_cvtps_pd(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
}
static inline v8d load8(const f16_t* p) {
    return (v8d)_mm512_cvtps_pd(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)));
}
#endif
// W consecutive elements (W = 4, or 8 with AVX-512) for the loops written for either width
template <int W> struct vec {
    static_assert(W == 4, "eight lanes need AVX-512");
    typedef v4d type;
};
#ifdef ABFT_V8
template <> struct vec<8> { typedef v8d type; };
#endif
template <int W, typename T>
static inline typename vec<W>::type load_w(const T* p) {
    if constexpr (W == 4) return load4(p);
#ifdef ABFT_V8
    else return load8(p);
#endif
}
template <int W>
static inline void store_w(double* p, typename vec<W>::type x) {
    if constexpr (W == 4) store4(p, x);
#ifdef ABFT_V8
    else store8(p, x);
#endif
}
template <int W>
static inline typename vec<W>::type splat_w(double x) {
    if constexpr (W == 4) return splat(x);
#ifdef ABFT_V8
    else return splat8(x);
#endif
}
template <int W>
static inline typename vec<W>::type abs_w(typename vec<W>::type x) {
    if constexpr (W == 4) return abs4(x);
#ifdef ABFT_V8
    else return abs8(x);
#endif
}

// a > b ? a : b lane by lane, in one instruction where there is AVX (MAXPD returns its second
// operand unless the first is greater: the same, NaN and signed zeros included; GCC emits a
// compare and a blend for the expression, two instructions on the ports the loops saturate)
static inline v4d max4(v4d a, v4d b) {
#ifdef __AVX__
    return (v4d)_mm256_max_pd((__m256d)a, (__m256d)b);
#else
    return a > b ? a : b;
#endif
}
// a < b ? a : b likewise (MINPD)
static inline v4d min4(v4d a, v4d b) {
#ifdef __AVX__
    return (v4d)_mm256_min_pd((__m256d)a, (__m256d)b);
#else
    return a < b ? a : b;
#endif
}

// A product kept rounded where it is computed (an empty asm the compiler cannot see through): the
// sums below must add the rounded products, as they add them from a scaled copy, and the compiler
// would otherwise fuse a product into the addition after it
static inline v4d kept(v4d v) {
#ifdef __AVX__
    __asm__("" : "+x"(v));
#else                                   // (SSE2: the four lanes in two registers)
    typedef double v2d __attribute__((vector_size(16)));
    v2d lo = {v[0], v[1]}, hi = {v[2], v[3]};
    __asm__("" : "+x"(lo), "+x"(hi));
    v = (v4d){lo[0], lo[1], hi[0], hi[1]};
#endif
    return v;
}
static inline double kept(double v) {
    __asm__("" : "+x"(v));
    return v;
}

// x^2 as the statistics add it: a float64 square rounded first (the other dtypes' are exact in
// float64: fused into the addition or not, the same sums)
template <typename T>
static inline v4d square(v4d v) { return std::is_same<T, double>::value ? kept(v * v) : v * v; }
template <typename T>
static inline double square(double v) { return std::is_same<T, double>::value ? kept(v * v) : v * v; }

// lanes_sum of sixteen accumulators held as four vectors (lanes 4u..4u+3 in l[u]): the same
// additions in the same order, three of them four wide
static_assert(LANES == 16, "lanes_sum4 holds LANES accumulators as four vectors");
static inline double lanes_sum4(const v4d* l) {
    const v4d h = (l[0] + l[2]) + (l[1] + l[3]);
    return (h[0] + h[2]) + (h[1] + h[3]);
}

// out[j * os] = sc[j] sum_k w_jk s[k] for the n rows x_j (K contiguous values, sx apart), w_jk =
// |x_jk| (ABS) or x_jk, in one order (sixteen lanes in four vectors, the K % 16 rest into the
// first lane, lanes_sum4; dots' one-vector rows are the one-row case), four rows at a time (s
// loaded once for the four). Not for float64 operands scaled before the product: with the
// scaling inside, the compiler contracts their products otherwise, so those keep dots on a
// scaled copy
template <int NR, bool ABS, typename T>
static inline void row_dots_tile(const T* x, i64 sx, const double* s, i64 K, const double* sc, double* out,
                                 i64 os) {
    v4d a[NR][4];
    for (int r = 0; r < NR; r++)
        for (int u = 0; u < 4; u++) a[r][u] = splat(0.0);
    i64 k = 0;
    for (; k + LANES <= K; k += LANES)
        for (int u = 0; u < 4; u++) {
            const v4d sv = load4(s + k + 4 * u);
            for (int r = 0; r < NR; r++) {
                v4d w = load4(x + r * sx + k + 4 * u);
                if (ABS) w = abs4(w);
                a[r][u] += w * sv;
            }
        }
    for (; k < K; k++)
        for (int r = 0; r < NR; r++) {
            double w = cvt(x[r * sx + k]);
            if (ABS) w = std::fabs(w);
            a[r][0][0] += w * s[k];
        }
    for (int r = 0; r < NR; r++) out[r * os] = lanes_sum4(a[r]) * sc[r];
}
template <bool ABS, typename T>
static void row_dots(const T* x, i64 sx, i64 n, const double* s, i64 K, const double* sc, double* out, i64 os) {
    i64 j = 0;
    for (; j + 4 <= n; j += 4) row_dots_tile<4, ABS>(x + j * sx, sx, s, K, sc + j, out + j * os, os);
    for (; j < n; j++) row_dots_tile<1, ABS>(x + j * sx, sx, s, K, sc + j, out + j * os, os);
}

// out[q * os] = m * sum_k v[k] rows[q * K + k] for q < n: one vector against n rows, four at a time
template <typename V>
static void dots(const V* v, const double* rows, i64 n, i64 K, double m, double* out, i64 os) {
    i64 q = 0;
    for (; q + 4 <= n; q += 4) {
        const double *q0 = rows + q * K, *q1 = q0 + K, *q2 = q1 + K, *q3 = q2 + K;
        double a0 = 0, a1 = 0, a2 = 0, a3 = 0;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
        for (i64 k = 0; k < K; k++) {
            const double vk = cvt(v[k]);
            a0 += vk * q0[k];
            a1 += vk * q1[k];
            a2 += vk * q2[k];
            a3 += vk * q3[k];
        }
        out[q * os] = a0 * m;
        out[(q + 1) * os] = a1 * m;
        out[(q + 2) * os] = a2 * m;
        out[(q + 3) * os] = a3 * m;
    }
    for (; q < n; q++)             // LANES accumulators in registers (four vectors)
        row_dots_tile<1, false>(v, 0, rows + q * K, K, &m, out + q * os, os);
}

// dots for two vectors at once (each row loaded once for both): o0 from v0 (times m0), o1 from v1
template <typename V>
static void dots2(const V* v0, const V* v1, const double* rows, i64 n, i64 K, double m0,
                  double m1, double* o0, double* o1, i64 os) {
    i64 q = 0;
    for (; q + 4 <= n; q += 4) {
        const double *q0 = rows + q * K, *q1 = q0 + K, *q2 = q1 + K, *q3 = q2 + K;
        double a0 = 0, a1 = 0, a2 = 0, a3 = 0, b0 = 0, b1 = 0, b2 = 0, b3 = 0;
#pragma omp simd reduction(+ : a0, a1, a2, a3, b0, b1, b2, b3)
        for (i64 k = 0; k < K; k++) {
            const double x = cvt(v0[k]), y = cvt(v1[k]);
            a0 += x * q0[k];
            a1 += x * q1[k];
            a2 += x * q2[k];
            a3 += x * q3[k];
            b0 += y * q0[k];
            b1 += y * q1[k];
            b2 += y * q2[k];
            b3 += y * q3[k];
        }
        o0[q * os] = a0 * m0; o0[(q + 1) * os] = a1 * m0; o0[(q + 2) * os] = a2 * m0; o0[(q + 3) * os] = a3 * m0;
        o1[q * os] = b0 * m1; o1[(q + 1) * os] = b1 * m1; o1[(q + 2) * os] = b2 * m1; o1[(q + 3) * os] = b3 * m1;
    }
    if (q < n) {
        dots(v0, rows + q * K, n - q, K, m0, o0 + q * os, os);
        dots(v1, rows + q * K, n - q, K, m1, o1 + q * os, os);
    }
}


// ---------------------------------------------------------------------------------------------
// out[r * os + q] (+= where add) sum_k x[r * sx + k] yt[k * S8 + q] for k < kc, NR rows of x and
// eight q: NR x 8 accumulators in registers over the k steps, in vectors of W lanes
template <int NR, int W = 4>
static inline void rows_tile(const double* x, i64 sx, const double* yt, i64 S8, i64 kc, double* out, i64 os,
                             bool add) {
    typedef typename vec<W>::type V;
    constexpr int NV = 8 / W;
    V acc[NR][NV];
    for (int r = 0; r < NR; r++)
        for (int v = 0; v < NV; v++) acc[r][v] = add ? load_w<W>(out + r * os + W * v) : splat_w<W>(0.0);
    for (i64 k = 0; k < kc; k++) {
        V y[NV];
        for (int v = 0; v < NV; v++) y[v] = load_w<W>(yt + k * S8 + W * v);
        for (int r = 0; r < NR; r++) {
            const V a = splat_w<W>(x[r * sx + k]);
            for (int v = 0; v < NV; v++) acc[r][v] += a * y[v];
        }
    }
    for (int r = 0; r < NR; r++)
        for (int v = 0; v < NV; v++) store_w<W>(out + r * os + W * v, acc[r][v]);
}

// out (nr, S8) = x' (nr, K) @ yt (K, S8), S8 a multiple of 8, x' = x (rows of stride sr, K
// contiguous) as float64, |x| where absx, each row times sc[r] where sc: in chunks of KC steps,
// each chunk of the rows converted into xb (nr x KC, one small block) before six rows at a time
// take it against the chunk of yt
constexpr i64 KC = 64, ROWS_G = 12;
template <typename T>
static void rows_times(const T* x, i64 sr, i64 nr, i64 K, const double* yt, i64 S8, bool absx, const double* sc,
                       double* out, double* xb) {
    for (i64 k0 = 0; k0 < K; k0 += KC) {
        const i64 kc = std::min(KC, K - k0);
        for (i64 r = 0; r < nr; r++) {
            const T* xr = x + r * sr + k0;
            double* b = xb + r * KC;
            i64 k = 0;
            for (; k + 4 <= kc; k += 4) store4(b + k, load4(xr + k));
            for (; k < kc; k++) b[k] = cvt(xr[k]);
            if (absx)
                for (k = 0; k < kc; k++) b[k] = std::fabs(b[k]);
            if (sc)
                for (k = 0; k < kc; k++) b[k] *= sc[r];
        }
        for (i64 q = 0; q < S8; q += 8) {
            const double* y = yt + k0 * S8 + q;
            i64 r = 0;
#ifdef ABFT_V8
            // one eight-lane vector a row: twelve rows, twelve chains of multiply-adds
            for (; r + 12 <= nr; r += 12) rows_tile<12, 8>(xb + r * KC, KC, y, S8, kc, out + r * S8 + q, S8, k0 > 0);
#endif
            for (; r + 6 <= nr; r += 6) rows_tile<6>(xb + r * KC, KC, y, S8, kc, out + r * S8 + q, S8, k0 > 0);
            for (; r + 2 <= nr; r += 2) rows_tile<2>(xb + r * KC, KC, y, S8, kc, out + r * S8 + q, S8, k0 > 0);
            for (; r < nr; r++) rows_tile<1>(xb + r * KC, KC, y, S8, kc, out + r * S8 + q, S8, k0 > 0);
        }
    }
}

// yt (K, S8) = y (S, K) transposed, zero beyond S (S8: S rounded up to eight; yt zero-filled)
static void transposed8(const double* y, i64 S, i64 K, double* yt) {
    const i64 S8 = (S + 7) / 8 * 8;
    for (i64 q = 0; q < S; q++)
        for (i64 k = 0; k < K; k++) yt[k * S8 + q] = y[q * K + k];
}

// ---------------------------------------------------------------------------------------------
// Operand statistics (stats.operand_stats) of the rows of x (R, K) with strides (sr, sk), per
// batch (offsets offs), for blocks of bs rows; with rhs (S, K) per batch: times = (x 2^-e) rhs^T.
// Summed as they are and scaled after by powers of two (stats_block: float64 blocks out of range
// are scaled first).
struct StatsOut {
    double *e, *r1, *rinf, *E, *x1, *xinf, *xs1, *xsinf, *nu, *s, *absum, *times;
    uint8_t *finite, *low;
};

// INV[n] = 1.0 / n for the counts of equal samples (n <= 64), INF for 0
static const struct Inv {
    double v[65];
    Inv() {
        v[0] = INF;
        for (int n = 1; n <= 64; n++) v[n] = 1.0 / n;
    }
    double operator[](int n) const { return v[n]; }
} INV;

#if defined(__AVX512F__) && defined(__AVX512CD__)
// Whether two of the first np (<= 16) of sixteen floats may be equal: vpconflictd marks each lane
// whose bits equal an earlier lane's, after every value equal to zero became +0 (a compare, not
// -0 + 0, which is -0 when rounding downward; distinct bits are then distinct values). A NaN
// equals nothing but its bits may repeat: then a "maybe", which the caller counts exactly.
static inline bool may_repeat16(const float* v, i64 np) {
    const __m512 z = _mm512_setzero_ps(), x0 = _mm512_load_ps(v);
    const __m512 x = _mm512_mask_mov_ps(x0, _mm512_cmp_ps_mask(x0, z, _CMP_EQ_OQ), z);
    const __m512i hits = _mm512_conflict_epi32(_mm512_castps_si512(x));
    const __mmask16 valid = (__mmask16)((1u << np) - 1);
    return _mm512_mask_test_epi32_mask(valid, hits, _mm512_set1_epi32((int)valid)) != 0;
}
#endif

#if defined(__AVX2__)
// Whether two of sixteen floats may be equal within lanes 0-7 or within lanes 8-15 (each compared
// with its rotations by 1-4: every pair of a half). With 16 samples a low-entropy row has some
// value at 4 places or more (4 or fewer distinct values, or one repeated 4 times), two of them in
// one half: none there, the row is not low. NaN equals nothing (torch's == too).
static inline bool halves_repeat16(const float* v) {
    const __m256 x0 = _mm256_load_ps(v), x1 = _mm256_load_ps(v + 8);
    __m256 hit = _mm256_setzero_ps();
    for (int r = 1; r <= 4; r++) {
        const __m256i idx = _mm256_setr_epi32(r & 7, (1 + r) & 7, (2 + r) & 7, (3 + r) & 7, (4 + r) & 7,
                                              (5 + r) & 7, (6 + r) & 7, (7 + r) & 7);
        hit = _mm256_or_ps(hit, _mm256_cmp_ps(x0, _mm256_permutevar8x32_ps(x0, idx), _CMP_EQ_OQ));
        hit = _mm256_or_ps(hit, _mm256_cmp_ps(x1, _mm256_permutevar8x32_ps(x1, idx), _CMP_EQ_OQ));
    }
    return _mm256_movemask_ps(hit) != 0;
}
#endif

// stats.low_entropy of one row (sampled at np places of stride sk), torch's formula branch-free:
// same_j = how many samples equal sample j (0 for NaN), distinct = sum_j 1 / same_j, repeated =
// the largest same_j of a nonzero sample. The samples are compared in S (float holds every
// half-precision and float value exactly: the same equalities, twice the lanes of double).
// Padded with NaN to 16 or 64 samples: a NaN equals nothing, so padding counts nowhere.
template <typename S, typename T>
static bool low_entropy(const T* row, i64 sk, const i64* places, i64 np) {
    using C = std::conditional_t<sizeof(S) == 8, int64_t, int32_t>;    // lanes as wide as S
    alignas(64) S v[64];
    alignas(64) C same[64];
    const int npad = np <= 16 ? 16 : 64;
    for (int j = 0; j < npad; j++) v[j] = j < np ? (S)cvt(row[places[j] * sk]) : (S)NaN;
    const i64 quarter = std::max<i64>(2, np / 4);
#if defined(__AVX512F__) && defined(__AVX512CD__)
    // no two samples equal (the usual case): not low (as below), found in one instruction
    if constexpr (sizeof(S) == 4)
        if (npad == 16 && np > quarter && !may_repeat16((const float*)v, np)) return false;
#elif defined(__AVX2__)
    // no two equal samples in either half (the usual case): not low (halves_repeat16); float
    // copies of double samples (values that differ may become equal: then the count below)
    if (np == 16) {
        alignas(32) float f[16];
        for (int j = 0; j < 16; j++) f[j] = (float)v[j];
        if (!halves_repeat16(f)) return false;
    }
#endif
    for (int j = 0; j < npad; j++) same[j] = 0;
    if (npad == 16) {
        for (int l = 0; l < 16; l++) {
            const S vl = v[l];
#pragma omp simd
            for (int j = 0; j < 16; j++) same[j] += v[j] == vl ? 1 : 0;
        }
    } else {
        for (int l = 0; l < 64; l++) {
            const S vl = v[l];
#pragma omp simd
            for (int j = 0; j < 64; j++) same[j] += v[j] == vl ? 1 : 0;
        }
    }
    C most = 0;
#pragma omp simd reduction(max : most)
    for (int j = 0; j < npad; j++) most = std::max(most, same[j]);
    // no two samples equal (the usual case): distinct is np (INF with a NaN) and repeated at most
    // 1, below quarter; so not low unless np <= quarter (a handful of samples: the formula below)
    if (most <= 1 && np > quarter) return false;
    // distinct is a count of distinct samples up to rounding (INF with a NaN among them), compared
    // with a half-integer: the order of its additions cannot change the answer
    double distinct = 0.0;
    C repeated = 0;
    for (i64 j = 0; j < np; j++) {
        distinct += INV[(int)same[j]];          // 1 / same[j] (INF for 0), without a division
        C r = v[j] != 0 ? same[j] : 0;
        repeated = r > repeated ? r : repeated;
    }
    return (distinct <= quarter + 0.5) || (repeated >= quarter);
}

// One or two contiguous rows (NR; x1 unread when 1): per row max |x| (NaN dropped: the caller
// redoes a row whose sum of squares is not finite) and sum of squares, in LANES accumulators;
// the rows' values and squares added into the column accumulators bsum and bsq, and with ABS
// their magnitudes into babs (the first row's, then the second's: the order of a row at a time).
// With PF (an operand from memory), each row's bytes ROW_PF_BYTES ahead are prefetched into L2,
// past a row's end the next pair's (n0, n1): at 4096^2 float32, one thread, 3.3 ms a pass against
// 6.0-8.1 without (the hardware prefetchers start afresh on every page of each row); 2 KB ahead
// 3.9, 8 KB 3.4 (BENCHMARKS.md, 2026-12-07).
constexpr i64 ROW_PF_BYTES = 4096;
template <int NR, bool ABS, bool PF, typename T>
static void row_pass(const T* __restrict x0, const T* __restrict x1, i64 K, double* __restrict bsum,
                     double* __restrict bsq, double* __restrict babs, double* amax, double* rsq,
                     const T* n0 = nullptr, const T* n1 = nullptr) {
    constexpr int L = LANES / 2;          // two rows' accumulators: as many registers as one's
    static_assert(L == 8, "two vectors of four lanes a row");
    // lanes 4h..4h+3 of each accumulator in its vector h (explicit vectors: GCC's own
    // vectorisation of this loop used two lanes a vector and spilled)
    v4d m0[2], s0[2], m1[2], s1[2];
    for (int h = 0; h < 2; h++) m0[h] = s0[h] = m1[h] = s1[h] = splat(0.0);
    i64 k = 0;
    for (; k + L <= K; k += L) {
        if (PF && (k * (i64)sizeof(T)) % 64 == 0) {
            const i64 kd = k + ROW_PF_BYTES / (i64)sizeof(T);
            if (kd < K) {
                __builtin_prefetch(x0 + kd, 0, 1);
                if (NR == 2) __builtin_prefetch(x1 + kd, 0, 1);
            } else if (n0 && kd - K < K) {
                __builtin_prefetch(n0 + (kd - K), 0, 1);
                __builtin_prefetch(n1 + (kd - K), 0, 1);
            }
        }
        for (int h = 0; h < 2; h++) {
            const i64 o = k + 4 * h;
            const v4d v = load4(x0 + o), av = abs4(v);
            m0[h] = max4(m0[h], av);
            s0[h] += square<T>(v);
            if (NR == 2) {
                const v4d w = load4(x1 + o), aw = abs4(w);
                m1[h] = max4(m1[h], aw);
                s1[h] += square<T>(w);
                store4(bsum + o, load4(bsum + o) + (v + w));
                store4(bsq + o, load4(bsq + o) + (square<T>(v) + square<T>(w)));
                if (ABS) store4(babs + o, (load4(babs + o) + av) + aw);
            } else {
                store4(bsum + o, load4(bsum + o) + v);
                store4(bsq + o, load4(bsq + o) + square<T>(v));
                if (ABS) store4(babs + o, load4(babs + o) + av);
            }
        }
    }
    alignas(64) double a0[L], q0[L], a1[L], q1[L];
    for (int h = 0; h < 2; h++) {
        store4(a0 + 4 * h, m0[h]);
        store4(q0 + 4 * h, s0[h]);
        store4(a1 + 4 * h, m1[h]);
        store4(q1 + 4 * h, s1[h]);
    }
    for (; k < K; k++) {
        double v = cvt(x0[k]), av = std::fabs(v);
        a0[0] = a0[0] > av ? a0[0] : av;
        q0[0] += square<T>(v);
        bsum[k] += v;
        bsq[k] += square<T>(v);
        if (ABS) babs[k] += av;
        if (NR == 2) {
            double w = cvt(x1[k]), aw = std::fabs(w);
            a1[0] = a1[0] > aw ? a1[0] : aw;
            q1[0] += square<T>(w);
            bsum[k] += w;
            bsq[k] += square<T>(w);
            if (ABS) babs[k] += aw;
        }
    }
    amax[0] = lanes_max<L>(a0);
    rsq[0] = lanes_sum<L>(q0);
    if (NR == 2) {
        amax[1] = lanes_max<L>(a1);
        rsq[1] = lanes_sum<L>(q1);
    }
}

// The largest number of equal pairs (a_r, b_r) among the rows r < n with ok_r and b_r not NaN
// (1 when none repeats), counted in a hash table (a sort costs more than the block's statistics).
static i64 most_equal(const double* a, const double* b, const uint8_t* ok, i64 n) {
    thread_local std::vector<uint64_t> ka, kb;
    thread_local std::vector<i64> cnt;
    int bits = 4;
    while ((i64(1) << bits) < 2 * n) bits++;
    const size_t size = size_t(1) << bits, mask = size - 1;
    if (ka.size() < size) {
        ka.resize(size);
        kb.resize(size);
        cnt.resize(size);
    }
    std::fill(cnt.begin(), cnt.begin() + size, 0);
    i64 best = 1;
    for (i64 r = 0; r < n; r++) {
        if (!ok[r] || b[r] != b[r]) continue;
        double x = a[r] + 0.0, y = b[r] + 0.0;         // -0 as +0: equal as doubles, one key
        uint64_t u, v;
        std::memcpy(&u, &x, 8);
        std::memcpy(&v, &y, 8);
        size_t h = (size_t)(((u * 0x9E3779B97F4A7C15ull) ^ v) * 0xC2B2AE3D27D4EB4Full >> (64 - bits));
        while (cnt[h] != 0 && (ka[h] != u || kb[h] != v)) h = (h + 1) & mask;
        ka[h] = u;
        kb[h] = v;
        best = std::max(best, ++cnt[h]);
    }
    return best;
}

// Short runs a stride apart (a block's rows of a column-major operand, a tile's rows of C) each
// lie on their own page, where the hardware prefetcher does not run ahead: loops over them
// prefetch the runs ahead (COLS_PF_AHEAD, C_PF_AHEAD), in operands of PF_BYTES or more (those come
// from memory: at 4096^2 float32 the strided statistics took 7.7 ms with 8 rows ahead against 11.3
// without; operands that stay in the caches gain nothing). A fixed size: a VM's sysconf reports the
// host's whole L3.
constexpr i64 PF_BYTES = 8 << 20;
// A check whose buffers hold up to REUSE_DOUBLES doubles (64 MB; an 8192 x 4096 x 4096 product's
// take 38 MB with 256-wide tiles) reuses its calling thread's, kept and grown; larger ones allocate
// their own per call. Fresh buffers fault their pages in on every call: at 2048^3 that was 416
// page faults and about a fifth of the check, at 4096^3 about a tenth. The workers of a batch
// checked a matrix a thread keep one matrix's buffers each, up to BATCH_REUSE_DOUBLES (4 MB).
constexpr double REUSE_DOUBLES = 1 << 23, BATCH_REUSE_DOUBLES = 1 << 19;
template <int LOCALITY = 3, typename T>
static inline void prefetch_run(const T* p, i64 n) {
    for (i64 j = 0; j < n; j += 64 / sizeof(T)) __builtin_prefetch(p + j, 0, LOCALITY);
}
// The passes down a column-block operand's rows (COLS) prefetch them COLS_PF_AHEAD rows ahead into
// L2: B's columns at 4096^2 float32, two threads, 0.77-0.86 of the time with 8 rows ahead into L1
// (16 ahead 0.81-0.86; 64 ahead 1.04-1.06 of 32's time; BENCHMARKS.md, 2026-12-07)
constexpr i64 COLS_PF_AHEAD = 32;
// and the pass over C its tiles' rows C_PF_AHEAD ahead into L2 (the whole check at 4096^3 float32:
// 0.94 of the time with 8 ahead into L1; 32 ahead no better)
constexpr i64 C_PF_AHEAD = 16;
// How a block's rows are read: ROWS, K contiguous (row_pass); ROWS_STRIDED, a row at a time through
// a float64 copy; COLS, rows contiguous and K strided (k outer, the block's rows inner).
enum BlockPath { ROWS, ROWS_STRIDED, COLS };
static inline BlockPath block_path(i64 R, i64 sr, i64 sk) {
    return (sr == 1 && sk != 1 && R > 1) ? COLS : sk == 1 ? ROWS : ROWS_STRIDED;
}

// A float64 row summed unscaled (stats_block) has its exponent within +-UNSCALED_EXP and finite sums
constexpr double UNSCALED_EXP = 400;
static inline bool out_of_range(double amax, double rsq) {
    return !fin(rsq) || !fin(amax) || std::fabs(expo(amax)) > UNSCALED_EXP;
}
constexpr i64 PROBE_K = 32;           // where a trial over strided rows looks at their maxima so far
// max |x| of row r as torch takes it (NaN kept)
template <typename T>
static double row_nmax(const T* x, i64 sr, i64 sk, i64 r, i64 K) {
    double m = 0.0;
    for (i64 k = 0; k < K; k++) m = nmax(m, std::fabs(cvt(x[r * sr + k * sk])));
    return m;
}

// One pass over a block's nr rows (x: its first row; strides sr, sk), in their own type and
// unscaled: per row max |x| (NaN dropped: a row whose sum of squares is not finite has it redone
// as torch takes it) and sum of squares; per k the block's sums of x, x^2 and |x| (need_abs); with
// tm, the rows' predictions x rhs^T (nr x S; rows_times with rhsT). A trial (stats_block) stops,
// false, at a row out of range, or strided rows with one out of range at their PROBE_K-th k.
template <typename T>
static bool block_sums(const T* x, i64 nr, i64 K, i64 sr, i64 sk, BlockPath path, bool pf, const double* rhs,
                       const double* rhsT, i64 S, bool need_abs, double* tm, double* amax, double* rsq,
                       double* bsum, double* bsq, double* babs, double* buf, double* xb, double* tg,
                       bool trial = false, i64 kb = 0, i64 ke = -1) {
    if (ke < 0) ke = K;
    if (kb == 0) {
        std::fill(amax, amax + nr, 0.0);
        std::fill(rsq, rsq + nr, 0.0);
        std::fill(bsum, bsum + K, 0.0);
        std::fill(bsq, bsq + K, 0.0);
        if (need_abs) std::fill(babs, babs + K, 0.0);
        if (tm) std::fill(tm, tm + nr * S, 0.0);
    }
    auto redo_max = [&](i64 r) { amax[r] = row_nmax(x, sr, sk, r, K); };   // a non-finite element
    if (path == ROWS) {
        // contiguous rows two at a time, read in their own type (no float64 copy): each pass
        // over the block's column accumulators adds two rows; with rhsT, the row predictions of
        // each group of ROWS_G rows while they are in L2
        const i64 S8 = (S + 7) / 8 * 8;
        i64 g0 = 0;
        for (i64 r = 0; r < nr; r += 2) {
            const T* x0 = x + r * sr;
            if (r + 1 < nr) {
                const T* n0 = r + 2 < nr ? x0 + 2 * sr : nullptr;
                const T* n1 = r + 3 < nr ? x0 + 3 * sr : n0;
                if (need_abs && pf) row_pass<2, true, true>(x0, x0 + sr, K, bsum, bsq, babs, &amax[r], &rsq[r], n0, n1);
                else if (need_abs) row_pass<2, true, false>(x0, x0 + sr, K, bsum, bsq, babs, &amax[r], &rsq[r]);
                else if (pf) row_pass<2, false, true>(x0, x0 + sr, K, bsum, bsq, babs, &amax[r], &rsq[r], n0, n1);
                else row_pass<2, false, false>(x0, x0 + sr, K, bsum, bsq, babs, &amax[r], &rsq[r]);
            } else {
                if (need_abs) row_pass<1, true, false>(x0, x0, K, bsum, bsq, babs, &amax[r], &rsq[r]);
                else row_pass<1, false, false>(x0, x0, K, bsum, bsq, babs, &amax[r], &rsq[r]);
            }
            for (i64 rr = r; rr < std::min(r + 2, nr); rr++) {
                if (trial && out_of_range(amax[rr], rsq[rr])) return false;
                if (!fin(rsq[rr])) redo_max(rr);
            }
            if (tm && rhsT) {
                const i64 rend = std::min(r + 2, nr);
                if (rend - g0 >= ROWS_G || rend == nr) {
                    rows_times(x + g0 * sr, sr, rend - g0, K, rhsT, S8, false, nullptr, tg, xb);
                    for (i64 g = g0; g < rend; g++)
                        for (i64 q = 0; q < S; q++) tm[g * S + q] = tg[(g - g0) * S8 + q];
                    g0 = rend;
                }
            } else if (tm && r + 1 < nr) {
                dots2(x0, x0 + sr, rhs, S, K, 1.0, 1.0, tm + r * S, tm + (r + 1) * S, 1);
            } else if (tm) {
                dots(x0, rhs, S, K, 1.0, tm + r * S, 1);
            }
        }
    } else if (path == ROWS_STRIDED) {
        double* buf2 = buf;
        for (i64 r = 0; r < nr; r++) {
            const T* xr = x + r * sr;
            double* buf = buf2 + (r % 2) * K;        // two rows' values: the row predictions in pairs
            for (i64 k = 0; k < K; k++) buf[k] = cvt(xr[k * sk]);
            // LANES independent accumulators (one per lane: GCC's omp-simd reduction keeps a
            // single vector, whose latency then bounds the loop)
            alignas(64) double ml[LANES] = {}, sl[LANES] = {};
            i64 k = 0;
            for (; k + LANES <= K; k += LANES) {
#pragma omp simd
                for (int l = 0; l < LANES; l++) {
                    double v = buf[k + l], av = std::fabs(v);
                    ml[l] = ml[l] > av ? ml[l] : av;     // NaN dropped: fixed below
                    sl[l] += square<T>(v);
                    bsum[k + l] += v;
                    bsq[k + l] += square<T>(v);
                }
            }
            for (; k < K; k++) {
                double v = buf[k], av = std::fabs(v);
                ml[0] = ml[0] > av ? ml[0] : av;
                sl[0] += square<T>(v);
                bsum[k] += v;
                bsq[k] += square<T>(v);
            }
            amax[r] = lanes_max(ml);
            rsq[r] = lanes_sum(sl);
            if (trial && out_of_range(amax[r], rsq[r])) return false;
            if (!fin(rsq[r])) redo_max(r);
            if (need_abs)
                for (i64 k = 0; k < K; k++) babs[k] += std::fabs(buf[k]);
            if (tm && r % 2 == 1)
                dots2(buf2, buf2 + K, rhs, S, K, 1.0, 1.0, tm + (r - 1) * S, tm + r * S, 1);
            else if (tm && r == nr - 1)
                dots(buf, rhs, S, K, 1.0, tm + r * S, 1);
        }
    } else {
        // rows strided, K strided by sk: walk k outer, the rows of the block inner (contiguous)
        std::vector<double> tt(tm ? nr * S : 0, 0.0);     // times, [q][r]
        const bool fused = tm && S == 1;
        auto probe = [&]() {
            for (i64 r = 0; r < nr; r++)
                if (amax[r] > 0 && out_of_range(amax[r], rsq[r])) return false;
            return true;
        };
        i64 k = kb;
#ifdef __AVX512F__
        // two values of k per pass over the rows' accumulators (half their loads and stores), each
        // k's sums in its own registers (24 of the 32), every sum in the order of the loop below
        for (; k + 2 <= ke; k += 2) {
            if (trial && k == PROBE_K && !probe()) return false;
            const T* xk = x + k * sk;
            double* __restrict am = amax;
            double* __restrict rq = rsq;
            double* __restrict b0 = buf;
            double* __restrict b1 = buf + nr;
            double* __restrict t0 = tt.data();
            const bool keep = tm != nullptr && !fused;
            const double w0 = fused ? rhs[k] : 0.0, w1 = fused ? rhs[k + 1] : 0.0;
            const v4d w04 = splat(w0), w14 = splat(w1);
            v4d l1[2][4], l2[2][4], la[2][4];
            for (int h = 0; h < 2; h++)
                for (int u = 0; u < 4; u++) l1[h][u] = l2[h][u] = la[h][u] = splat(0.0);
            if (pf && k + COLS_PF_AHEAD + 1 < K) {
                prefetch_run<1>(xk + COLS_PF_AHEAD * sk, nr);
                prefetch_run<1>(xk + (COLS_PF_AHEAD + 1) * sk, nr);
            }
            i64 r = 0;
            for (; r + LANES <= nr; r += LANES) {
                for (int u = 0; u < 4; u++) {
                    const i64 o = r + 4 * u;
                    const v4d v = load4(xk + o), w = load4(xk + sk + o), av = abs4(v), aw = abs4(w);
                    if (keep) {
                        store4(b0 + o, v);
                        store4(b1 + o, w);
                    }
                    if (fused) store4(t0 + o, (load4(t0 + o) + v * w04) + w * w14);
                    v4d m = load4(am + o);
                    m = max4(m, av);                          // NaN dropped: fixed below
                    store4(am + o, max4(m, aw));
                    store4(rq + o, (load4(rq + o) + square<T>(v)) + square<T>(w));
                    l1[0][u] += v;
                    l2[0][u] += square<T>(v);
                    la[0][u] += av;
                    l1[1][u] += w;
                    l2[1][u] += square<T>(w);
                    la[1][u] += aw;
                }
            }
            for (; r < nr; r++)
                for (int h = 0; h < 2; h++) {
                    double v = cvt(xk[h * sk + r]), av = std::fabs(v);
                    if (keep) (h ? b1 : b0)[r] = v;
                    if (fused) t0[r] += v * (h ? w1 : w0);
                    am[r] = am[r] > av ? am[r] : av;
                    rq[r] += square<T>(v);
                    l1[h][0][0] += v;
                    l2[h][0][0] += square<T>(v);
                    la[h][0][0] += av;
                }
            for (int h = 0; h < 2; h++) {
                bsum[k + h] = lanes_sum4(l1[h]);
                bsq[k + h] = lanes_sum4(l2[h]);
                if (need_abs) babs[k + h] = lanes_sum4(la[h]);
            }
            if (keep)
                for (i64 q = 0; q < S; q++) {
                    const double u0 = rhs[q * K + k], u1 = rhs[q * K + k + 1];
                    double* __restrict tq = tt.data() + q * nr;
                    for (i64 r = 0; r < nr; r++) tq[r] = (tq[r] + b0[r] * u0) + b1[r] * u1;
                }
        }
#endif
        for (; k < ke; k++) {
            if (trial && k == PROBE_K && !probe()) return false;
            const T* xk = x + k * sk;
            double* __restrict am = amax;
            double* __restrict rq = rsq;
            double* __restrict bf = buf;
            v4d l1[4], l2[4], la[4];       // LANES accumulators each, in registers
            for (int u = 0; u < 4; u++) l1[u] = l2[u] = la[u] = splat(0.0);
            if (pf && k + COLS_PF_AHEAD < K) prefetch_run<1>(xk + COLS_PF_AHEAD * sk, nr);
            // with one block of B's columns (S == 1), each row's prediction is added here
            // (the loop below's operations, in its order per row); with more, the values are
            // kept for that loop
            const bool keep = tm != nullptr && !fused;
            double* __restrict t0 = tt.data();
            const double w0 = fused ? rhs[k] : 0.0;
            const v4d w4 = splat(w0);
            i64 r = 0;
            for (; r + LANES <= nr; r += LANES) {
                for (int u = 0; u < 4; u++) {
                    const i64 o = r + 4 * u;
                    const v4d v = load4(xk + o), av = abs4(v), m = load4(am + o);
                    if (keep) store4(bf + o, v);
                    if (fused) store4(t0 + o, load4(t0 + o) + v * w4);
                    store4(am + o, max4(m, av));                  // NaN dropped: fixed below
                    store4(rq + o, load4(rq + o) + square<T>(v));
                    l1[u] += v;
                    l2[u] += square<T>(v);
                    la[u] += av;
                }
            }
            for (; r < nr; r++) {
                double v = cvt(xk[r]), av = std::fabs(v);
                if (keep) bf[r] = v;
                if (fused) t0[r] += v * w0;
                am[r] = am[r] > av ? am[r] : av;
                rq[r] += square<T>(v);
                l1[0][0] += v;
                l2[0][0] += square<T>(v);
                la[0][0] += av;
            }
            bsum[k] = lanes_sum4(l1);
            bsq[k] = lanes_sum4(l2);
            if (need_abs) babs[k] = lanes_sum4(la);
            if (keep)
                for (i64 q = 0; q < S; q++) {
                    double w = rhs[q * K + k];
                    double* tq = tt.data() + q * nr;
                    for (i64 r = 0; r < nr; r++) tq[r] += buf[r] * w;
                }
        }
        if (tm)
            for (i64 r = 0; r < nr; r++)
                for (i64 q = 0; q < S; q++) tm[r * S + q] = tt[q * nr + r];
        for (i64 r = 0; ke == K && r < nr; r++)
            if (!fin(rsq[r])) redo_max(r);
    }
    return true;
}

// A block's statistics from one pass, summed unscaled and scaled after by powers of two. Float64
// blocks (pre) are summed so only on trial (its rows' exponents within +-UNSCALED_EXP, finite);
// a block out of that range is done again from float64 copies scaled first (a row by its own
// exponent for its sums and predictions, the block by its largest for the per-k sums), in the
// same loops, the same additions in the same order. Within the range |x| < 2^401 keeps every
// square, product and sum finite, and scaling commutes with rounding but below the normal range:
// the statistics of x and x 2^j are the same bits unless a square, a product with the predictions'
// right-hand side or a block's sum falls there, and differ then by less than 2^-1022 in scaled
// units, far below any threshold. (Scaling every block first took a pass of its own over it, and
// the block came from L3 or memory a second time: float64 checks at 2048^3 and 4096^3 took 1.3x
// as long.)
#ifndef NEUMAIER_K_VALUE
#define NEUMAIER_K_VALUE 64
#endif
constexpr i64 NEUMAIER_K = NEUMAIER_K_VALUE;
template <typename T>
static void stats_block(const T* x, i64 R, i64 K, i64 sr, i64 sk, i64 bs, i64 p, const i64* places,
                        i64 np, const double* rhs, const double* rhsT, i64 S, bool need_abs, bool pre,
                        StatsOut o, i64 rbase, i64 tbase, double* bsum, double* bsq, double* babs,
                        double* buf, double* xb, double* tg, double* rowv, bool summed = false) {
    const i64 i0 = p * bs, i1 = std::min(R, i0 + bs), nr = i1 - i0;
    const BlockPath path = block_path(R, sr, sk);
    const bool pf = path != ROWS_STRIDED && R * K * (i64)sizeof(T) >= PF_BYTES;
    // per row (rowv: five rows' worth, the caller's per thread): max |x|, sum of squares, exponent,
    // and the scaled copies' maxima and sums of squares
    double *amax = rowv, *rsq = rowv + nr, *e = rowv + 2 * nr, *cmax = rowv + 3 * nr, *csq = rowv + 4 * nr;
    double* tm = o.times ? o.times + (rbase + i0) * S : nullptr;
    const T* xb0 = x + i0 * sr;
    bool scaled = !summed && !block_sums(xb0, nr, K, sr, sk, path, pf, rhs, rhsT, S, need_abs, tm, amax, rsq,
                                         bsum, bsq, babs, buf, xb, tg, pre);
    if (scaled) {                   // a trial stopped early: the rows' maxima, as torch takes them
        if (path == COLS) {         // (in the block's own order)
            std::fill(amax, amax + nr, 0.0);
            for (i64 k = 0; k < K; k++)
                for (i64 r = 0; r < nr; r++) amax[r] = nmax(amax[r], std::fabs(cvt(xb0[r * sr + k * sk])));
        } else {
            for (i64 r = 0; r < nr; r++) amax[r] = row_nmax(xb0, sr, sk, r, K);
        }
    }
    double Em = -INF;
    for (i64 r = 0; r < nr; r++) {
        e[r] = expo(amax[r]);
        if (fin(amax[r]) && amax[r] > 0) Em = std::max(Em, e[r]);
    }
    const double E = fin(Em) ? Em : 0.0;
    for (i64 r = 0; pre && r < nr && !scaled; r++) scaled = out_of_range(amax[r], rsq[r]);
    if (scaled) {
        // copies of the block in float64, laid out as x is (so the same loops read them): scaled by
        // each row's exponent, then by the block's; a calling thread keeps up to 8 MB of them
        const bool cols = path == COLS;
        thread_local std::vector<double> kept_cp;
        std::vector<double> fresh_cp;
        const size_t ncp = (size_t)nr * K;
        std::vector<double>& cpv = ncp <= (size_t(1) << 20) ? kept_cp : fresh_cp;
        if (cpv.size() < ncp) cpv.resize(ncp);
        double* cp = cpv.data();
        const i64 csr = cols ? 1 : K, csk = cols ? nr : 1;
        auto scaled_copy = [&](bool by_row) {
            double* f = cmax;                // free until block_sums writes the copies' maxima there
            for (i64 r = 0; r < nr; r++) f[r] = pow2(by_row ? -e[r] : -E);
            if (cols)
                for (i64 k = 0; k < K; k++)
                    for (i64 r = 0; r < nr; r++) cp[r + k * csk] = cvt(xb0[r * sr + k * sk]) * f[r];
            else
                for (i64 r = 0; r < nr; r++)
                    for (i64 k = 0; k < K; k++) cp[r * csr + k] = cvt(xb0[r * sr + k * sk]) * f[r];
        };
        scaled_copy(true);
        block_sums(cp, nr, K, csr, csk, path, false, rhs, rhsT, S, false, tm, cmax, rsq, bsum, bsq, babs, buf,
                   xb, tg);
        scaled_copy(false);
        block_sums(cp, nr, K, csr, csk, path, false, nullptr, nullptr, 0, need_abs, nullptr, cmax, csq, bsum,
                   bsq, babs, buf, xb, tg);
    }
    if (std::is_same<T, double>::value && K <= NEUMAIER_K) {
        // float64 data: the check's unit is the data's, and plain sums of a block's rows err by up
        // to several units in their last place, which the threshold's allowance for the check's own
        // arithmetic does not cover (BENCHMARKS.md, 2026-12-07: a false alarm in 19 of 400 products
        // of positive rows at small K). The block sums again, compensated (Neumaier), of the same
        // values: a sum that is not finite keeps the plain one.
        thread_local std::vector<double> ns, nc;
        if ((i64)ns.size() < K) ns.resize(K), nc.resize(K);
        std::fill(ns.begin(), ns.begin() + K, 0.0);
        std::fill(nc.begin(), nc.begin() + K, 0.0);
        const double f = scaled ? pow2(-E) : 1.0;
        for (i64 r = 0; r < nr; r++)
            for (i64 k = 0; k < K; k++) {
                const double v = cvt(xb0[r * sr + k * sk]) * f, t = ns[k] + v;
                nc[k] += std::fabs(ns[k]) >= std::fabs(v) ? (ns[k] - t) + v : (v - t) + ns[k];
                ns[k] = t;
            }
        for (i64 k = 0; k < K; k++) {
            const double t = ns[k] + nc[k];
            if (fin(t)) bsum[k] = t;
        }
    }
    // per row
    for (i64 r = 0; r < nr; r++) {
        i64 g = rbase + i0 + r;
        double row = scaled ? 1.0 : pow2(-e[r]);
        o.e[g] = e[r];
        o.r1[g] = rsq[r] * (row * row);
        double sc = amax[r] * pow2(-e[r]);
        o.rinf[g] = sc * sc;
        o.finite[g] = fin(amax[r]);
        if (tm)
            for (i64 q = 0; q < S; q++) tm[r * S + q] *= row;
    }
    // per block
    double blk = scaled ? 1.0 : pow2(-E), x1 = 0.0, xinf = 0.0, xs1 = 0.0, xsinf = 0.0;
    double* so = o.s ? o.s + (tbase + p) * K : nullptr;
    double* ao = o.absum ? o.absum + (tbase + p) * K : nullptr;
    for (i64 k = 0; k < K; k++) {
        double s = bsum[k] * blk, q2 = bsq[k] * (blk * blk), s2 = s * s;
        x1 += q2;
        xs1 += s2;
        xinf = k ? nmax(xinf, q2) : q2;
        xsinf = k ? nmax(xsinf, s2) : s2;
        if (so) so[k] = s;
        if (ao) ao[k] = babs[k] * blk;
    }
    i64 t = tbase + p;
    o.E[t] = E;
    o.x1[t] = x1;
    o.xinf[t] = xinf;
    o.xs1[t] = xs1;
    o.xsinf[t] = xsinf;
    // stats.low_entropy: np sampled places
    i64 nlow = 0;
    for (i64 i = i0; i < i1; i++) {
        i64 g = rbase + i;
        if (K == 0) {
            o.low[g] = true;
        } else {
            o.low[g] = sizeof(T) == 8 ? low_entropy<double>(x + i * sr, sk, places, np)
                                      : low_entropy<float>(x + i * sr, sk, places, np);
        }
        nlow += o.low[g] != 0;
    }
    // nu: the largest number of rows with equal (exponent, scaled sum of squares), or of
    // low-entropy rows (stats.operand_stats)
    i64 best = most_equal(o.e + rbase + i0, o.r1 + rbase + i0, o.finite + rbase + i0, nr);
    o.nu[t] = (double)std::max(best, nlow);
}

// for (i < n) body(i, local) on th threads (at most n), each thread's local from init(); schedule
// static, or dynamic (one index at a time: jobs of uneven cost). On one thread no OpenMP call at
// all: inside a batch's region (check_batches) each region would cost a team's set-up, about a
// microsecond, and a bare worksharing loop would bind to the outer team; and a single job (one
// block of B's columns) took 33 us in a region of two threads against 20 alone (512 x 256 x 256).
template <typename Init, typename Body>
static void parallel_for(int th, i64 n, Init init, Body body, bool dynamic = false) {
    if (th > n) th = (int)std::max<i64>(n, 1);
    if (th == 1) {
        auto local = init();
        for (i64 i = 0; i < n; i++) body(i, local);
        return;
    }
#pragma omp parallel num_threads(th)
    {
        auto local = init();
        if (dynamic) {
#pragma omp for schedule(dynamic, 1)
            for (i64 i = 0; i < n; i++) body(i, local);
        } else {
#pragma omp for schedule(static)
            for (i64 i = 0; i < n; i++) body(i, local);
        }
    }
}

// Blocks a job of a column-block operand from memory takes together, and rows a turn (stats_sides)
constexpr i64 COLS_G = 4, COLS_K = 64;
// One operand's statistics job: its blocks' rows (columns of B, rows of A), and for A the
// right-hand side of the row predictions (rhs: S rows of K per batch of B, rhs_idx the batch of B
// of each batch).
struct StatsArgs {
    const void* x;
    i64 nb;
    const i64* offs;
    i64 R, K, sr, sk, bs;
    const i64* places;
    i64 np;
    const double* rhs;
    const i64* rhs_idx;
    i64 S;
    bool need_abs, pre;
    StatsOut o;
};

// The statistics of n operands of one dtype (one, or a weight's two sides), all their blocks
// spread over the threads together, each block on one thread (an operand of one block then does
// not leave the other threads idle; a block's results do not depend on the thread).
template <typename T>
static void stats_sides(const StatsArgs* sd, int n, int nt) {
    // A job is one block, or COLS_G neighbouring blocks of an operand read a column block at a
    // time (COLS) from memory (PF_BYTES), without predictions, not float64: their passes go down
    // the rows together, COLS_K rows at a time, so each row's bytes are read as one run of COLS_G
    // blocks (4 KB of float32) instead of runs a block wide on a page each (the same sums, block
    // by block, in the same order; B's columns at 4096^2 float32, two threads: 4.5 ms against 6.3)
    std::vector<i64> first(n + 1, 0), group(n, 1);      // each side's first job, blocks a job
    std::vector<std::vector<double>> rhsT(n);   // rhs transposed, where rows_times takes the predictions
    i64 K = 0, wbuf = 0, rows = 0, S8 = 0;
    bool any_tiles = false;
    double work = 0;
    for (int i = 0; i < n; i++) {
        const StatsArgs& a = sd[i];
        const bool rowmajor = block_path(a.R, a.sr, a.sk) != COLS;
        if (!rowmajor && !a.pre && !a.rhs && a.R * a.K * (i64)sizeof(T) >= PF_BYTES) group[i] = COLS_G;
        first[i + 1] = first[i] + a.nb * (((a.R + a.bs - 1) / a.bs + group[i] - 1) / group[i]);
        K = std::max(K, a.K);
        wbuf = std::max(wbuf, rowmajor ? 2 * a.K : std::max(a.K, 2 * a.bs));    // two rows' values
        rows = std::max(rows, std::min(a.bs, a.R));
        work += (double)a.nb * a.R * a.K;
        // the row predictions by rows_times where each row meets eight or more rhs rows (fewer: dots)
        if (a.rhs && a.S >= 8 && rowmajor && a.sk == 1) {
            const i64 s8 = (a.S + 7) / 8 * 8;
            i64 nrhs = 0;
            for (i64 b = 0; b < a.nb; b++) nrhs = std::max(nrhs, a.rhs_idx[b] + 1);
            rhsT[i].assign(nrhs * a.K * s8, 0.0);
            for (i64 ib = 0; ib < nrhs; ib++)
                transposed8(a.rhs + ib * a.S * a.K, a.S, a.K, rhsT[i].data() + ib * a.K * s8);
            any_tiles = true;
            S8 = std::max(S8, s8);
        }
    }
    const i64 gmax = *std::max_element(group.begin(), group.end());
    struct Bufs { std::vector<double> bsum, bsq, babs, buf, xb, tg, rowv; };
    parallel_for(threads_for(nt, work), first[n],
                 [&] { return Bufs{std::vector<double>(gmax * (K + 1)), std::vector<double>(gmax * (K + 1)),
                                   std::vector<double>(gmax * (K + 1)), std::vector<double>(gmax * (wbuf + 1)),
                                   std::vector<double>(any_tiles ? ROWS_G * KC : 0),
                                   std::vector<double>(any_tiles ? ROWS_G * S8 : 0),
                                   std::vector<double>(gmax * (5 * rows + 1))}; },
                 [&](i64 job, Bufs& w) {
            int i = 0;
            while (job >= first[i + 1]) i++;
            const StatsArgs& a = sd[i];
            const i64 tb = (a.R + a.bs - 1) / a.bs, g = group[i], gb = (tb + g - 1) / g;
            const i64 b = (job - first[i]) / gb, p0 = (job - first[i]) % gb * g, p1 = std::min(tb, p0 + g);
            const i64 s8 = (a.S + 7) / 8 * 8;
            const T* x = (const T*)a.x + a.offs[b];
            auto at = [&](std::vector<double>& v, i64 j) { return v.data() + j * (v.size() / gmax); };
            if (g > 1)
                for (i64 k0 = 0; k0 < a.K; k0 += COLS_K)
                    for (i64 p = p0; p < p1; p++) {
                        const i64 i0 = p * a.bs, nr = std::min(a.R, i0 + a.bs) - i0;
                        double* rv = at(w.rowv, p - p0);
                        block_sums(x + i0 * a.sr, nr, a.K, a.sr, a.sk, COLS, true, nullptr, nullptr, 0, a.need_abs,
                                   nullptr, rv, rv + nr, at(w.bsum, p - p0), at(w.bsq, p - p0), at(w.babs, p - p0),
                                   at(w.buf, p - p0), nullptr, nullptr, false, k0, std::min(a.K, k0 + COLS_K));
                    }
            for (i64 p = p0; p < p1; p++)
                stats_block<T>(x, a.R, a.K, a.sr, a.sk, a.bs, p, a.places, a.np,
                               a.rhs ? a.rhs + a.rhs_idx[b] * a.S * a.K : nullptr,
                               rhsT[i].empty() ? nullptr : rhsT[i].data() + a.rhs_idx[b] * a.K * s8, a.S,
                               a.need_abs, a.pre, a.o, b * a.R, b * tb, at(w.bsum, p - p0), at(w.bsq, p - p0),
                               at(w.babs, p - p0), at(w.buf, p - p0), w.xb.data(), w.tg.data(), at(w.rowv, p - p0),
                               g > 1);
        }, true);
}

#define DISPATCH(dt, FN, ...)                                       \
    switch (dt) {                                                   \
        case DT_F32: FN<float>(__VA_ARGS__); break;                 \
        case DT_F64: FN<double>(__VA_ARGS__); break;                \
        case DT_BF16: FN<bf16_t>(__VA_ARGS__); break;               \
        case DT_F16: FN<f16_t>(__VA_ARGS__); break;                 \
        default: return 1;                                          \
    }

// One operand's statistics as abft_stats is asked for them.
// dims: dtype, batches, R, K, strides of x (r, k), bs, number of sampled places, need_abs, threads.
// ptrs: x, the batches' offsets, the places, then the outputs e, r1, rinf, finite, low, E, x1, xinf,
// xs1, xsinf, nu, s, absum (null where not need_abs). One array each (ctypes converts each
// argument of a call: thirty of them cost more than the Python around the call).
static StatsArgs stats_args(const i64* dims, const void* const* ptrs) {
    auto d = [&](int i) { return (double*)ptrs[i]; };
    return StatsArgs{ptrs[0], dims[1], (const i64*)ptrs[1], dims[2], dims[3], dims[4], dims[5], dims[6],
                     (const i64*)ptrs[2], dims[7], nullptr, nullptr, 0, dims[8] != 0, dims[0] == DT_F64,
                     StatsOut{d(3), d(4), d(5), d(8), d(9), d(10), d(11), d(12), d(13), d(14), d(15), nullptr,
                              (uint8_t*)ptrs[6], (uint8_t*)ptrs[7]}};
}

extern "C" int abft_stats(const i64* dims, const void* const* ptrs) {
    const StatsArgs a = stats_args(dims, ptrs);
    if (a.np > 64) return 2;
    DISPATCH(dims[0], stats_sides, &a, 1, (int)dims[9]);
    return 0;
}

// The statistics of two operands of one dtype in one call (a weight's both sides: W for x W^T,
// W^T for g W), each as abft_stats computes it; the first's threads.
extern "C" int abft_stats2(const i64* dims0, const void* const* ptrs0, const i64* dims1,
                           const void* const* ptrs1) {
    const StatsArgs a[2] = {stats_args(dims0, ptrs0), stats_args(dims1, ptrs1)};
    if (a[0].np > 64 || a[1].np > 64) return 2;
    if (dims0[0] != dims1[0]) return 3;
    DISPATCH(dims0[0], stats_sides, a, 2, (int)dims0[9]);
    return 0;
}

// ---------------------------------------------------------------------------------------------
// out[p, j0:j0+W NV] += sum_{k0 <= k < k1} s[p, k] x[k, j0:j0+W NV] for NP rows of s (stride K), x's
// rows contiguous (stride N), |x| where ABS, x times sc (W NV scales) where PRE: the NP x NV
// accumulators of W lanes held in registers over the K steps. Each output's sum is one chain of
// multiply-adds in k order, whatever NP, NV and W (the same bits); NP x NV chains hide the
// multiply-add's latency.
// Where pf is not 0, row k's columns at x + k N + pf are prefetched into L2 (the next chunk of K):
// the tile goes down rows a cache line or more apart, which the hardware prefetchers follow too
// late to keep up (a 2304-column B streamed at 7-8 GB/s without, 18 with).
template <int NP, int NV, bool ABS, bool PRE, int W, typename T>
static inline void thin_tile(const T* x, i64 xs, i64 N, const double* s, i64 K, i64 k0, i64 k1, const double* sc,
                             double* out, i64 pf) {
    typedef typename vec<W>::type V;
    constexpr int LINES = (W * NV * (int)sizeof(T) + 63) / 64;
    V acc[NP][NV], scv[NV];
    for (int p = 0; p < NP; p++)
        for (int v = 0; v < NV; v++) acc[p][v] = splat_w<W>(0.0);
    for (int v = 0; v < NV; v++) scv[v] = PRE ? load_w<W>(sc + W * v) : splat_w<W>(1.0);
    for (i64 k = k0; k < k1; k++) {
        const T* xk = x + k * xs;
        if (pf)
            for (int l = 0; l < LINES; l++) __builtin_prefetch(xk + pf + l * (64 / (int)sizeof(T)), 0, 1);
        V xv[NV];
        for (int v = 0; v < NV; v++) {
            xv[v] = load_w<W>(xk + W * v);
            if (ABS) xv[v] = abs_w<W>(xv[v]);
            if (PRE) xv[v] *= scv[v];
        }
        for (int p = 0; p < NP; p++) {
            const V a = splat_w<W>(s[p * K + k]);
            for (int v = 0; v < NV; v++) acc[p][v] += a * xv[v];
        }
    }
    for (int p = 0; p < NP; p++) {
        double* o = out + p * N;
        for (int v = 0; v < NV; v++) store_w<W>(o + W * v, load_w<W>(o + W * v) + acc[p][v]);
    }
}

// thin_tile for all TM rows of s, G at a time, then what remains in fewer; the first group
// prefetches. G x NV accumulators: sixteen of the 32 vector registers with AVX-512 (16 columns:
// eight rows in eight-lane tiles, four in four-lane ones), twelve of the sixteen without (8
// columns, six rows). One tile of fewer than four rows leaves the multiply-add units waiting
// (one of 8 columns: four chains).
#ifdef __AVX512F__
constexpr int THIN_ACC = 16;
#else
constexpr int THIN_ACC = 12;
#endif
constexpr i64 THIN_CW4 = THIN_ACC >= 16 ? 16 : 8;    // columns a tile for four rows of s or more
#ifdef ABFT_V8
constexpr int THIN_W = 8;                             // the tiles' lanes
#else
constexpr int THIN_W = 4;
#endif
constexpr i64 THIN_CW1 = 8 * THIN_W;                  // columns a tile for one row of s
template <int NV, bool ABS, bool PRE, typename T>
static void thin_tiles(const T* x, i64 xs, i64 N, const double* s, i64 K, i64 TM, i64 k0, i64 k1, const double* sc,
                       double* out, i64 pf) {
    // NV: groups of four columns; NW vectors of THIN_W lanes a row of s
    static_assert(NV * 4 % THIN_W == 0, "a tile's columns fill its vectors");
    constexpr int NW = NV * 4 / THIN_W, GMAX = THIN_W == 8 ? 8 : 6,
                  G = THIN_ACC / NW < GMAX ? THIN_ACC / NW : GMAX;
    i64 p = 0;
    auto tile = [&](auto np) {
        thin_tile<decltype(np)::value, NW, ABS, PRE, THIN_W>(x, xs, N, s + p * K, K, k0, k1, sc, out + p * N, pf);
        p += np;
        pf = 0;
    };
    while (p + G <= TM) tile(std::integral_constant<int, G>{});
    while (p < TM) {
        const i64 r = TM - p;
        if (G > 4 && r >= 4) tile(std::integral_constant<int, 4>{});
        else if (G > 3 && r == 3) tile(std::integral_constant<int, 3>{});
        else if (G > 2 && r >= 2) tile(std::integral_constant<int, 2>{});
        else tile(std::integral_constant<int, 1>{});
    }
}

// thin_tiles for columns 4NV wide, by the run-time choice of |x| and scaling
template <int NV, typename T>
static void thin_cols(bool absb, bool pre, const T* x, i64 xs, i64 N, const double* s, i64 K, i64 TM, i64 k0,
                      i64 k1, const double* sc, double* out, i64 pf) {
    if (pre && absb) thin_tiles<NV, true, true>(x, xs, N, s, K, TM, k0, k1, sc, out, pf);
    else if (pre) thin_tiles<NV, false, true>(x, xs, N, s, K, TM, k0, k1, sc, out, pf);
    else if (absb) thin_tiles<NV, true, false>(x, xs, N, s, K, TM, k0, k1, sc, out, pf);
    else thin_tiles<NV, false, false>(x, xs, N, s, K, TM, k0, k1, sc, out, pf);
}

// The thin product out (TM, N) = s (TM, K) @ (|b| if absb else b) (K, N), each column times
// 2^-f_j (float64 operands: b scaled before the product, else the result after).
template <typename T>
static void thin_t(const T* b, i64 K, i64 N, i64 sk, i64 sn, const double* s, i64 TM, const double* f,
                   bool absb, bool pre, int nt, double* out) {
    if (sn == 1 && N >= 8) {
        // rows of b contiguous, each sk apart (a view of a wider matrix's columns has sk > N: they
        // were read N apart, and every tile alarmed): strips of W columns, K in chunks of KT rows
        // (a strip's chunk, 128 KB of float32, stays in L2 for the groups of rows of s), a tile's
        // accumulators in registers
        // (strips of at most 256 columns, as many as a multiple of the threads where the columns
        // allow: a product of 256 to 768 columns no longer leaves a thread idle; a column's sum
        // does not depend on its strip)
        // (a multiple of the tiles' width, so only the last strip has narrower tiles)
        const int th = threads_for(nt, (double)TM * K * N);
        const i64 cw = TM >= 4 ? THIN_CW4 : TM >= 2 ? 16 : THIN_CW1;
        const i64 KT = 128, per = (N + 255) / 256, even = (per + th - 1) / th * th,
                  W = std::min<i64>(256, std::max<i64>(cw, ((N + even - 1) / even + cw - 1) / cw * cw)),
                  strips = (N + W - 1) / W;
        // prefetch the next chunk where b comes from memory (PF_BYTES; a b of 6 MB: 1-3% slower
        // with it in a loop here; 16-21 MB: 13-24% faster)
        const bool stream = K * N * (i64)sizeof(T) >= PF_BYTES;
        std::vector<double> scale(N);                     // 2^-f_j
        for (i64 j = 0; j < N; j++) scale[j] = pow2(-f[j]);
        // strip st's chunk k0..k1, b's row k at xb + k xs
        // (ahead, its bytes: spread over the column groups, prefetched into L2)
        auto chunk = [&](i64 st, i64 k0, i64 k1, const T* xb, i64 xs, i64 pf, const char* ahead = nullptr,
                         i64 ahead_bytes = 0) {
            const i64 j0 = st * W, w = std::min(W, N - j0), w8 = w / 8 * 8;
            const double* sc = scale.data() + j0;
            const i64 per_group = (ahead_bytes / 64 + w8 / 8) / std::max<i64>(1, w8 / 8) * 64;
            i64 done = 0;
            // columns in groups of cw: 16 (8 for four rows of s or more without AVX-512)
            // or 32 (one row; 64 in eight-lane tiles): eight or more chains of multiply-adds
            i64 j = 0;
            for (; j + cw <= w8; j += cw) {
                for (i64 q = 0; ahead && q < per_group * (cw / 8) && done < ahead_bytes; q += 64, done += 64)
                    __builtin_prefetch(ahead + done, 0, 1);
                const T* x = xb + j0 + j;
                double* o = out + j0 + j;
                const double* c = sc + j;
                if constexpr (THIN_CW1 == 64)      // (eight-lane tiles only)
                    if (cw == 64) {
                        thin_cols<16>(absb, pre, x, xs, N, s, K, TM, k0, k1, c, o, pf);
                        continue;
                    }
                if (cw == 32) thin_cols<8>(absb, pre, x, xs, N, s, K, TM, k0, k1, c, o, pf);
                else if (cw == 16) thin_cols<4>(absb, pre, x, xs, N, s, K, TM, k0, k1, c, o, pf);
                else thin_cols<2>(absb, pre, x, xs, N, s, K, TM, k0, k1, c, o, pf);
            }
            for (; j < w8; j += 8)
                thin_cols<2>(absb, pre, xb + j0 + j, xs, N, s, K, TM, k0, k1, sc + j, out + j0 + j, pf);
            for (i64 j = w8; j < w; j++)          // the last (up to seven) columns
                for (i64 p = 0; p < TM; p++) {
                    double a = 0.0;
                    for (i64 k = k0; k < k1; k++) {
                        double v = cvt(xb[k * xs + j0 + j]);
                        if (absb) v = std::fabs(v);
                        a += s[p * K + k] * (pre ? v * sc[j] : v);
                    }
                    out[p * N + j0 + j] += a;
                }
        };
        auto begin = [&](i64 st) {
            const i64 j0 = st * W, w = std::min(W, N - j0);
            for (i64 p = 0; p < TM; p++) std::fill(out + p * N + j0, out + p * N + j0 + w, 0.0);
        };
        auto end = [&](i64 st) {
            const i64 j0 = st * W, w = std::min(W, N - j0);
            if (!pre)
                for (i64 p = 0; p < TM; p++)
                    for (i64 j = 0; j < w; j++) out[p * N + j0 + j] *= scale[j0 + j];
        };
        auto none = [] { return 0; };
        if (stream && sk * (i64)sizeof(T) % 4096 == 0 && TM >= 4 && THIN_W == 4) {
            // b's rows a multiple of 4 KB apart and from memory: a chunk's rows of one group of
            // columns all fall in one set of L1 and a few of L2, and the passes after the first
            // over them (one per group of rows of s) came from L3 or memory (the float32 4096^3
            // product: 13.3-14.6 ms, 8.0-8.3 ms at 4104 columns). Each chunk is copied first, row
            // by row (whole rows, in order), to rows a line more apart (10.8-10.9 ms); the same
            // sums. (Packing a chunk's groups of columns as float64, or blocks of 4 rows for every
            // group of rows of s in turn, gave nothing: BENCHMARKS.md.) Four-lane tiles only (an
            // AVX2 Zen 3): eight-lane tiles take a chunk in half as many passes, each group of
            // columns a whole line, and on a Zen 4 the copy cost more than it saved (thin_t at
            // 4096^3 float32, two threads: 6.5-7.0 ms without, 8.4-9.0 with; 2048^3 1.0-1.1 against
            // 1.6).
            const i64 XS = N + 64 / (i64)sizeof(T);
            std::vector<T> pad((size_t)KT * XS);
            parallel_for(th, strips, none, [&](i64 st, int) { begin(st); });
            for (i64 k0 = 0; k0 < K; k0 += KT) {
                const i64 k1 = std::min(K, k0 + KT);
                parallel_for(th, k1 - k0, none, [&](i64 r, int) {
                    std::memcpy(pad.data() + r * XS, b + (k0 + r) * sk, N * sizeof(T));
                });
                // the next chunk's rows, in order, shared out among the strips (into L2; what L2
                // cannot hold goes on to L3): the copy then finds them there
                const i64 n1 = std::min(K, k1 + KT) - k1;
                parallel_for(th, strips, none, [&](i64 st, int) {
                    const i64 r0 = k1 + n1 * st / strips, r1 = k1 + n1 * (st + 1) / strips;
                    chunk(st, k0, k1, pad.data() - k0 * XS, XS, 0, (const char*)(b + r0 * sk),
                          (r1 - r0) * sk * (i64)sizeof(T));
                });
            }
            parallel_for(th, strips, none, [&](i64 st, int) { end(st); });
        } else {
            parallel_for(th, strips, none, [&](i64 st, int) {
                begin(st);
                for (i64 k0 = 0; k0 < K; k0 += KT) {
                    const i64 k1 = std::min(K, k0 + KT);
                    chunk(st, k0, k1, b, sk, stream && k1 < K ? KT * sk : 0);
                }
                end(st);
            });
        }
    } else if (sn == 1 || sk != 1) {
        // rows of b contiguous (or neither): out[:, strip] += s[:, k] * b[k, strip]
        i64 W = std::min(N, std::max<i64>(16, std::min<i64>(512, (1 << 11) / std::max<i64>(TM, 1))));
        i64 strips = (N + W - 1) / W;
        struct Bufs { std::vector<double> row, sc; };
        parallel_for(threads_for(nt, (double)TM * K * N), strips,
                     [&] { return Bufs{std::vector<double>(4 * W), std::vector<double>(W)}; },
                     [&](i64 st, Bufs& bf) {
                std::vector<double>&row = bf.row, &sc = bf.sc;
                i64 j0 = st * W, w = std::min(W, N - j0);
                for (i64 j = 0; j < w; j++) sc[j] = pow2(-f[j0 + j]);
                for (i64 p = 0; p < TM; p++) std::fill(out + p * N + j0, out + p * N + j0 + w, 0.0);
                // four rows of b at a time: four products added per load and store of out
                for (i64 k0 = 0; k0 < K; k0 += 4) {
                    i64 kn = std::min<i64>(4, K - k0);
                    for (i64 kk = 0; kk < 4; kk++) {
                        double* rw = row.data() + kk * W;
                        if (kk >= kn) {
                            std::fill(rw, rw + w, 0.0);
                            continue;
                        }
                        const T* bk = b + (k0 + kk) * sk + j0 * sn;
                        for (i64 j = 0; j < w; j++) {
                            double v = cvt(bk[j * sn]);
                            if (absb) v = std::fabs(v);
                            rw[j] = pre ? v * sc[j] : v;
                        }
                    }
                    const double *r0 = row.data(), *r1 = r0 + W, *r2 = r1 + W, *r3 = r2 + W;
                    // two rows of out at a time (each load of b's four rows serves both), four
                    // multiply-adds in a chain (fewer operations than a tree: this loop is bound by them)
                    i64 p = 0;
                    for (; p + 2 <= TM; p += 2) {
                        const double *sp = s + p * K + k0, *sq = sp + K;
                        double a0 = sp[0], a1 = kn > 1 ? sp[1] : 0, a2 = kn > 2 ? sp[2] : 0, a3 = kn > 3 ? sp[3] : 0;
                        double b0 = sq[0], b1 = kn > 1 ? sq[1] : 0, b2 = kn > 2 ? sq[2] : 0, b3 = kn > 3 ? sq[3] : 0;
                        double *op = out + p * N + j0, *oq = op + N;
#pragma omp simd
                        for (i64 j = 0; j < w; j++) {
                            const double x0 = r0[j], x1 = r1[j], x2 = r2[j], x3 = r3[j];
                            op[j] = std::fma(a3, x3, std::fma(a2, x2, std::fma(a1, x1, std::fma(a0, x0, op[j]))));
                            oq[j] = std::fma(b3, x3, std::fma(b2, x2, std::fma(b1, x1, std::fma(b0, x0, oq[j]))));
                        }
                    }
                    for (; p < TM; p++) {
                        const double* sp = s + p * K + k0;
                        double a0 = sp[0], a1 = kn > 1 ? sp[1] : 0, a2 = kn > 2 ? sp[2] : 0, a3 = kn > 3 ? sp[3] : 0;
                        double* op = out + p * N + j0;
#pragma omp simd
                        for (i64 j = 0; j < w; j++)
                            op[j] = std::fma(a3, r3[j], std::fma(a2, r2[j], std::fma(a1, r1[j], std::fma(a0, r0[j], op[j]))));
                    }
                }
                if (!pre)
                    for (i64 p = 0; p < TM; p++)
                        for (i64 j = 0; j < w; j++) out[p * N + j0 + j] *= sc[j];
            });
    } else if (TM >= 8) {
        // columns of b contiguous, eight or more rows of s: groups of ROWS_G columns of b against
        // s^T by rows_times (each column its own row there)
        const i64 S8 = (TM + 7) / 8 * 8, groups = (N + ROWS_G - 1) / ROWS_G;
        std::vector<double> sT(K * S8, 0.0);
        transposed8(s, TM, K, sT.data());
        struct Bufs { std::vector<double> xb, tg, sc; };
        parallel_for(threads_for(nt, (double)TM * K * N), groups,
                     [&] { return Bufs{std::vector<double>(ROWS_G * KC), std::vector<double>(ROWS_G * S8),
                                       std::vector<double>(ROWS_G)}; },
                     [&](i64 gi, Bufs& bf) {
                std::vector<double>&xb = bf.xb, &tg = bf.tg, &sc = bf.sc;
                const i64 j0 = gi * ROWS_G, nj = std::min(ROWS_G, N - j0);
                for (i64 j = 0; j < nj; j++) sc[j] = pow2(-f[j0 + j]);
                rows_times(b + j0 * sn, sn, nj, K, sT.data(), S8, absb, pre ? sc.data() : nullptr, tg.data(),
                           xb.data());
                for (i64 j = 0; j < nj; j++)
                    for (i64 p = 0; p < TM; p++) out[p * N + j0 + j] = tg[j * S8 + p] * (pre ? 1.0 : sc[j]);
            });
    } else if (TM < 4 && !pre) {
        // columns of b contiguous, fewer than four rows of s: each row of s against the columns,
        // four columns at a time (each a row of row_dots), in groups of 64 columns
        std::vector<double> sc(N);
        for (i64 j = 0; j < N; j++) sc[j] = pow2(-f[j]);
        const i64 G = 64, groups = (N + G - 1) / G;
        parallel_for(threads_for(nt, (double)TM * K * N), groups, [] { return 0; }, [&](i64 gi, int&) {
            const i64 j0 = gi * G, nj = std::min(G, N - j0);
            for (i64 p = 0; p < TM; p++)
                if (absb) row_dots<true>(b + j0 * sn, sn, nj, s + p * K, K, sc.data() + j0, out + p * N + j0, 1);
                else row_dots<false>(b + j0 * sn, sn, nj, s + p * K, K, sc.data() + j0, out + p * N + j0, 1);
        });
    } else {
        // columns of b contiguous: dot products over k
        parallel_for(threads_for(nt, (double)TM * K * N), N, [&] { return std::vector<double>(K + 1); },
                     [&](i64 j, std::vector<double>& col) {
                const T* bj = b + j * sn;
                double sc = pow2(-f[j]);
                if (absb || pre) {
                    for (i64 k = 0; k < K; k++) {
                        double v = cvt(bj[k]);
                        if (absb) v = std::fabs(v);
                        col[k] = pre ? v * sc : v;
                    }
                } else {
                    for (i64 k = 0; k < K; k++) col[k] = cvt(bj[k]);
                }
                dots(col.data(), s, TM, K, pre ? 1.0 : sc, out + j, N);
            });
    }
}

// ---------------------------------------------------------------------------------------------
// eta of the checksums' split error for a sum whose first side's exponent is ex (one exp2 for
// all the sums that share ex)
static double eta_of(const double* c, double ex) {
    return std::exp2(std::max(c[ETA_LOG2] - c[ETA_ABSOLUTE] * ex, -1000.0));
}

// The thresholds of four checked sums (threshold.threshold, term for term; eta = eta_of(c, ex))
// that share the first side (x: a block of A's rows, or of B's columns) and differ in the second
// (y) and their own sums, lane by lane (the uniform branches on the coefficients taken once)
typedef long long m4 __attribute__((vector_size(32)));         // lane masks: -1 true, 0 false
static inline v4d sel(m4 m, v4d a, v4d b) { return (v4d)((m & (m4)a) | (~m & (m4)b)); }
static inline m4 fin4(v4d v) { return (v - v) == splat(0.0); }
static inline v4d nmin4(v4d a, v4d b) {
    const m4 nan = (a != a) | (b != b);
    return sel(nan, splat(NaN), sel(a < b, a, b));
}
static inline v4d nmax4(v4d a, v4d b) {
    const m4 nan = (a != a) | (b != b);
    return sel(nan, splat(NaN), sel(a > b, a, b));
}
static inline v4d sq_capped4(v4d v) { v4d vv = v * v; return sel(vv > splat(DMAX), splat(DMAX), vv); }
static inline v4d sqrt4(v4d v) {
#if defined(__AVX__)
    return (v4d)_mm256_sqrt_pd((__m256d)v);
#else
    return (v4d){std::sqrt(v[0]), std::sqrt(v[1]), std::sqrt(v[2]), std::sqrt(v[3])};
#endif
}
static inline v4d pow2_4(v4d e) { return (v4d){pow2(e[0]), pow2(e[1]), pow2(e[2]), pow2(e[3])}; }

// x 2^e, e at least -1000, in two factors (pow2_hi, pow2_lo; threshold._times_pow2)
static inline v4d times_pow2_4(v4d x, v4d e) {
    e = sel(splat(-1000.0) < e, e, splat(-1000.0));
    x *= (v4d){pow2_hi(e[0]), pow2_hi(e[1]), pow2_hi(e[2]), pow2_hi(e[3])};
    if (e[0] > POW2_SPLIT || e[1] > POW2_SPLIT || e[2] > POW2_SPLIT || e[3] > POW2_SPLIT)
        x *= (v4d){pow2_lo(e[0]), pow2_lo(e[1]), pow2_lo(e[2]), pow2_lo(e[3])};
    return x;
}

static inline __attribute__((always_inline)) v4d threshold4(const double* c, v4d s1, v4d s2, v4d sa,
                        v4d pred, double x1, double xinf, double xs1, double xsinf, v4d y1, v4d yinf,
                        double nu, m4 low, double ex, v4d ey, bool has_d, v4d d2, v4d da, bool has_t,
                        v4d t, v4d nout, double eta) {
    v4d q = nmin4(x1 * yinf, xinf * y1), qs = nmin4(xs1 * yinf, xsinf * y1);
    v4d prod = c[P_S2] * s2 + c[P_Q] * q;
    if (has_d) prod += c[P_D2] * d2;
    v4d check = c[C_P2] * sq_capped4(pred) + c[C_QS] * qs + nu * (c[C_S12] * sq_capped4(s1) + c[C_S2] * s2 +
                                                                    c[C_Q] * q);
    // a skipped term (coefficient 0) adds nothing where its operands are finite, NaN where not
    m4 bad = (m4)splat(0.0);
    const bool has_split = c[ETA_LOG2] > -1000.0 || c[ETA_ABSOLUTE] != 0;
    v4d split = splat(0.0);
    if (has_split) {
        split = eta * sqrt4(c[KK] * y1);       // the checksums' split error, deterministic
    } else {
        bad |= ~fin4(y1);
    }
    v4d ap = abs4(pred);
    v4d thr = c[LAM] * sqrt4(nu * prod + check) + c[BIAS] * ap;
    if (c[DIRECTED] != 0) {
        thr += c[DIRECTED] * (0.5 * ap + sqrt4(q / 3));
    } else {
        bad |= ~fin4(ap) | ~fin4(q);
    }
    if (c[DIRECTED_CHK] != 0) {
        thr += c[DIRECTED_CHK] * (0.5 * ap + sqrt4(qs / 3));
    } else {
        bad |= ~fin4(ap) | ~fin4(qs);
    }
    const v4d tq = std::sqrt(c[BS] * std::max(c[KK], 1.0)) * sqrt4(q);     // (bs K q may overflow)
    v4d mag = nmax4(sa, tq);
    if (has_d) mag += 2.0 * da;
    thr += sel(low, c[LOWENT] * mag, splat(0.0));
    if (c[REP] != 0 && nu > 1) thr += (c[REP] * (nu - 1.0)) * (sa + tq);
    if (c[OUT] != 0) thr += c[OUT] * sa;
    else bad |= ~fin4(sa);
    thr = sel(bad, splat(NaN), thr);
    if (c[OUT_ADD] != 0 && has_d) thr += c[OUT_ADD] * da;
    // eta per product term and stored element at 2^-(ex + ey); per product of the predicted dot
    // product at 2^-ey (0 here: its predictions are float64; the fused kernels' term)
    v4d uf = times_pow2_4(c[BS] * c[KK] * c[ETA_ACC] + nout * c[ETA_OUT], -(ex + ey));
    if (c[FTZ] != 0)
        uf += c[FTZ] * (c[BS] * pow2(-ex) * sqrt4(c[KK] * y1) +
                        pow2_4(-ey) * std::sqrt(c[BS] * c[KK] * x1));
    if (c[CHK_PARTS] != 0) uf += times_pow2_4(splat(c[KK] * c[CHK_PARTS] * c[ETA_ACC]), -ey);
    thr += uf;
    if (has_split) thr += split;
    if (c[CAP] != 0 && has_t) {
        v4d w = c[W_T] * t + c[W_SA] * sa + uf;
        if (has_d) w += (c[W_DA] + c[OUT_ADD]) * da;
        if (has_split) w += split;
        thr = nmin4(thr, w * c[W_SCALE]);
    }
    return sel(thr < splat(FLOOR), splat(FLOOR), thr);
}

// One side's statistics, per row (y) and per block (x), as pointers into stats buffers.
struct Side {
    const double *e, *r1, *rinf, *E, *x1, *xinf, *xs1, *xsinf, *nu;
    const uint8_t *finite, *low;
};

// Output sums of one element z (already scaled where pre) read as raw: value, square, magnitude,
// non-finite count (of raw: a finite float64 that overflows when scaled is no non-finite output,
// and its sums, inf, leave the threshold unformed), count below the half type's normal range.
struct Acc { double s1 = 0, s2 = 0, sa = 0, nf = 0, ns = 0; };
static inline void add(Acc& a, double z, double raw, double tiny) {
    if (!fin(raw)) {
        a.nf += 1;
        a.ns += tiny > 0;
        return;
    }
    a.s1 += z;
    a.s2 += sq_capped(z);
    a.sa += std::fabs(z);
    a.ns += std::fabs(z) < tiny;
}

// The column sums of up to four clean rows of a tile (the first n of rows): values,
// squares (clamped to the largest double, as a corrupted value's may overflow), magnitudes, and
// (tiny > 0) the count below the half type's normal range.
static void add_columns(const double* const* rows, int n, i64 w, double tiny, double* __restrict c1,
                        double* __restrict c2, double* __restrict ca, double* __restrict cs) {
    const double *__restrict x = rows[0], *__restrict y = rows[1], *__restrict u = rows[2],
                 *__restrict v = rows[3];
    if (n == 4) {
        for (i64 j = 0; j < w; j++) {
            c1[j] += (x[j] + y[j]) + (u[j] + v[j]);
            c2[j] += (sq_capped(x[j]) + sq_capped(y[j])) + (sq_capped(u[j]) + sq_capped(v[j]));
            ca[j] += (std::fabs(x[j]) + std::fabs(y[j])) + (std::fabs(u[j]) + std::fabs(v[j]));
        }
    } else {
        for (int r = 0; r < n; r++) {
            const double* __restrict z = rows[r];
            for (i64 j = 0; j < w; j++) {
                c1[j] += z[j];
                c2[j] += sq_capped(z[j]);
                ca[j] += std::fabs(z[j]);
            }
        }
    }
    if (tiny > 0)
        for (int r = 0; r < n; r++)
            for (i64 j = 0; j < w; j++) cs[j] += std::fabs(rows[r][j]) < tiny ? 1.0 : 0.0;
}

// Clean rows whose column sums wait to be added four at a time
struct Pending {
    const double* row[4] = {nullptr, nullptr, nullptr, nullptr};
    int n = 0;
    void add(i64 w, double tiny, double* c1, double* c2, double* ca, double* cs) {
        if (n) add_columns(row, n, w, tiny, c1, c2, ca, cs);
        n = 0;
    }
};

// seg[j] = x[j] as float64 (KEEP) and the sums of x, x^2 and |x| over j < w, in LANES
// accumulators each (held in registers: four vectors per sum); with MIN, *mn = min |x| (rows whose
// sums are finite); with SCALE, of x sc instead of x
template <bool KEEP, typename T, bool MIN = false, bool SCALE = false>
static void load_sums(const T* __restrict x, i64 w, double* __restrict seg, double& s1, double& s2,
                      double& sa, double* mn = nullptr, double sc = 1.0) {
    // float64 squares rounded before they are added, on every path alike (those of other dtypes
    // are exact: fused or not, the same sums)
    constexpr bool SQ_KEPT = std::is_same<T, double>::value;
    v4d a1[4], a2[4], aa[4], am[4];
    for (int u = 0; u < 4; u++) a1[u] = a2[u] = aa[u] = splat(0.0), am[u] = splat(INF);
    i64 j = 0;
    for (; j + LANES <= w; j += LANES) {
        for (int u = 0; u < 4; u++) {
            const v4d v = SCALE ? kept(load4(x + j + 4 * u) * splat(sc)) : load4(x + j + 4 * u), m = abs4(v);
            if (KEEP) store4(seg + j + 4 * u, v);
            a1[u] += v;
            a2[u] += SQ_KEPT ? kept(v * v) : v * v;
            aa[u] += m;
            if (MIN) am[u] = min4(m, am[u]);
        }
    }
    for (; j < w; j++) {
        double v = SCALE ? kept(cvt(x[j]) * sc) : cvt(x[j]);
        if (KEEP) seg[j] = v;
        a1[0][0] += v;
        a2[0][0] += SQ_KEPT ? kept(v * v) : v * v;
        aa[0][0] += std::fabs(v);
        if (MIN) am[0][0] = std::fabs(v) < am[0][0] ? std::fabs(v) : am[0][0];
    }
    s1 = lanes_sum4(a1);
    s2 = lanes_sum4(a2);
    sa = lanes_sum4(aa);
    if (MIN) {
        for (int u = 1; u < 4; u++) am[0] = am[u] < am[0] ? am[u] : am[0];
        *mn = std::min(std::min(am[0][0], am[0][1]), std::min(am[0][2], am[0][3]));
    }
}

// The column sums of four rows (rows4): of their values, or with SCALE (float64) of their values
// times scol[j] kept rounded, whose squares are clamped as add_columns clamps them (those of the
// other dtypes are exact and cannot overflow: whether or not the compiler fuses them into
// multiply-adds changes no value); with COUNT each row's and column's count below tiny
template <bool COUNT, bool SCALE, typename T>
static void cols4(const T* __restrict x, const T* __restrict y, const T* __restrict u, const T* __restrict v,
                  i64 w, const double* __restrict scol, double tiny, double* __restrict c1,
                  double* __restrict c2, double* __restrict ca, double* __restrict cs, double* ns) {
    v4d n4[4] = {splat(0.0), splat(0.0), splat(0.0), splat(0.0)};
    const v4d t4 = splat(tiny);
    const v4i one = (v4i)splat(1.0);
    i64 j = 0;
    for (; j + 4 <= w; j += 4) {
        v4d a = load4(x + j), b = load4(y + j), e = load4(u + j), f = load4(v + j);
        if (SCALE) {
            const v4d s = load4(scol + j);
            a = kept(a * s), b = kept(b * s), e = kept(e * s), f = kept(f * s);
        }
        const v4d aa = abs4(a), ab = abs4(b), ae = abs4(e), af = abs4(f);
        store4(c1 + j, load4(c1 + j) + ((a + b) + (e + f)));
        if (SCALE)
            store4(c2 + j, load4(c2 + j) + ((sq_capped4(a) + sq_capped4(b)) + (sq_capped4(e) + sq_capped4(f))));
        else
            store4(c2 + j, load4(c2 + j) + ((a * a + b * b) + (e * e + f * f)));
        store4(ca + j, load4(ca + j) + ((aa + ab) + (ae + af)));
        if (COUNT) {
            const v4d m0 = (v4d)((aa < t4) & one), m1 = (v4d)((ab < t4) & one), m2 = (v4d)((ae < t4) & one),
                      m3 = (v4d)((af < t4) & one);
            n4[0] += m0; n4[1] += m1; n4[2] += m2; n4[3] += m3;
            store4(cs + j, load4(cs + j) + ((m0 + m1) + (m2 + m3)));
        }
    }
    for (; j < w; j++) {
        double a = cvt(x[j]), b = cvt(y[j]), e = cvt(u[j]), f = cvt(v[j]);
        if (SCALE) a = kept(a * scol[j]), b = kept(b * scol[j]), e = kept(e * scol[j]), f = kept(f * scol[j]);
        c1[j] += (a + b) + (e + f);
        if (SCALE)
            c2[j] += (sq_capped(a) + sq_capped(b)) + (sq_capped(e) + sq_capped(f));
        else
            c2[j] += (a * a + b * b) + (e * e + f * f);
        ca[j] += (std::fabs(a) + std::fabs(b)) + (std::fabs(e) + std::fabs(f));
        if (COUNT) {
            const double q[4] = {a, b, e, f};
            for (int r = 0; r < 4; r++) {
                const double m = std::fabs(q[r]) < tiny ? 1.0 : 0.0;
                n4[r][0] += m;
                cs[j] += m;
            }
        }
    }
    for (int r = 0; r < 4; r++) ns[r] = COUNT ? (n4[r][0] + n4[r][1]) + (n4[r][2] + n4[r][3]) : 0.0;
}

// Four consecutive rows of a tile of C (sc apart, contiguous) as the pass over C takes them when
// all four are clean and none waits: each row's sums as load_sums gives them (rs: s1, s2, sa, ns),
// and the four rows' column sums added as add_columns adds four pending rows, the same values in
// the same order, read from C twice instead of through a float64 copy. Float64 is scaled before
// its sums as the copies scale it: a row's by sr[r], a column's by scol[j]. False, nothing added,
// when a row's sums are not finite. The counts below tiny (tiny > 0: the half types) are taken
// only when a row's smallest magnitude is below it.
template <typename T>
static bool rows4(const T* __restrict c, i64 sc, i64 w, const double* sr, const double* scol, double tiny,
                  double* __restrict c1, double* __restrict c2, double* __restrict ca, double* __restrict cs,
                  double (*rs)[4]) {
    constexpr bool SCALE = std::is_same<T, double>::value;
    double mn = INF;
    for (int r = 0; r < 4; r++) {
        double m = INF;
        if (SCALE)
            load_sums<false, T, false, true>(c + r * sc, w, (double*)nullptr, rs[r][0], rs[r][1], rs[r][2],
                                             nullptr, sr[r]);
        else if (tiny > 0)
            load_sums<false, T, true>(c + r * sc, w, (double*)nullptr, rs[r][0], rs[r][1], rs[r][2], &m);
        else
            load_sums<false>(c + r * sc, w, (double*)nullptr, rs[r][0], rs[r][1], rs[r][2]);
        if (!(fin(rs[r][1]) && fin(rs[r][0]))) return false;
        mn = std::min(mn, m);
    }
    double ns[4];
    if (tiny > 0 && mn < tiny)
        cols4<true, SCALE>(c, c + sc, c + 2 * sc, c + 3 * sc, w, scol, tiny, c1, c2, ca, cs, ns);
    else
        cols4<false, SCALE>(c, c + sc, c + 2 * sc, c + 3 * sc, w, scol, tiny, c1, c2, ca, cs, ns);
    for (int r = 0; r < 4; r++) rs[r][3] = ns[r];
    return true;
}

// Statistics kept in the library's own memory (A's always, B's unless the caller kept them).
// Grown, never shrunk: every element a call reads it has written first (a buffer reused across
// calls keeps the last call's values beyond that).
template <typename X>
static X* grown(std::vector<X>& v, i64 n) {
    if ((i64)v.size() < n) v.resize(n);
    return v.data();
}

struct StatsBuf {
    std::vector<double> e, r1, rinf, E, x1, xinf, xs1, xsinf, nu, s, absum, times;
    std::vector<uint8_t> finite, low;
    StatsOut out(i64 nb, i64 R, i64 T, i64 K, bool need_abs, i64 S) {
        for (auto* v : {&e, &r1, &rinf}) grown(*v, nb * R);
        for (auto* v : {&E, &x1, &xinf, &xs1, &xsinf, &nu}) grown(*v, nb * T);
        grown(finite, nb * R);
        grown(low, nb * R);
        grown(s, nb * T * K);
        grown(absum, need_abs ? nb * T * K : 0);
        grown(times, S ? nb * R * S : 0);
        return StatsOut{e.data(), r1.data(), rinf.data(), E.data(), x1.data(), xinf.data(), xs1.data(),
                        xsinf.data(), nu.data(), s.data(), need_abs ? absum.data() : nullptr,
                        S ? times.data() : nullptr, finite.data(), low.data()};
    }
};

static Side side_of(const StatsOut& o) {
    return Side{o.e, o.r1, o.rinf, o.E, o.x1, o.xinf, o.xs1, o.xsinf, o.nu, o.finite, o.low};
}

struct CheckArgs {
    i64 nbc, nbb, M, N, K, bm, bn, scm, scn, sam, sak, sbk, sbn, sdm, sdn;
    const i64 *offc, *offa, *offb, *offbb, *offd, *ib, *places;
    i64 np;
    const void *a, *b, *c;
    const double* d;                 // the addend, float64, times beta (null: none)
    Side A, B;                       // A's stats per c-batch, B's per b-batch (ib)
    const double *times, *sA, *absA, *absB, *sB;   // (nbc, M, TN), (nbc, TM, K) x 2, (nbb, TN, K) x 2
    const double *coef_c, *coef_r;
    double alpha, tiny, dtmax;
    int dt, cap, nt;
    bool units;                      // the residuals and thresholds returned: in C's units
    bool reuse;                      // the buffers are the calling thread's (footprint <= REUSE_DOUBLES)
    float* verdict;
    float *detail_r, *detail_c;
    double *res_c, *thr_c, *res_r, *thr_r;
};

// The doubles a check's buffers hold, from above: statistics per row and block, block sums, output
// sums and predictions per sum, residuals and thresholds
static double footprint(const CheckArgs& g) {
    const double M = g.M, N = g.N, K = g.K, TM = std::ceil(M / g.bm), TN = std::ceil(N / g.bn);
    return g.nbc * ((M * TN + TM * N) * 16 + (M + N) * 16 + (TM + TN) * K * 2);
}

template <typename T>
static void check_t(CheckArgs g) {
    const i64 M = g.M, N = g.N, K = g.K, bm = g.bm, bn = g.bn;
    const i64 TM = (M + bm - 1) / bm, TN = (N + bn - 1) / bn;
    STAGE(">");
    // A check reuses its calling thread's buffers (REUSE_DOUBLES: allocating and zeroing them
    // cost 15% of a 64^3 check, page faults a fifth of a 2048^3 one); a larger one allocates its own.
    struct Buffers {
        StatsBuf bs, as;
        std::vector<double> predc, tcol, trow, colz, rowz;
        std::vector<uint8_t> anynf;
    };
    thread_local Buffers kept;
    Buffers fresh;
    Buffers& bufs = g.reuse ? kept : fresh;
    StatsBuf &bs_ = bufs.bs, &as_ = bufs.as;
    // B's statistics (the columns of B: rows of B^T), unless kept; then A's with the row predictions
    if (g.B.e == nullptr) {
        StatsOut o = bs_.out(g.nbb, N, TN, K, g.cap != 0, 0);
        const StatsArgs b{g.b, g.nbb, g.offbb, N, K, g.sbn, g.sbk, bn, g.places, g.np, nullptr, nullptr, 0,
                          g.cap != 0, g.dt == DT_F64, o};
        stats_sides<T>(&b, 1, g.nt);
        g.B = side_of(o);
        g.absB = o.absum;
        g.sB = o.s;
    }
    STAGE("statsB");
    {
        StatsOut o = as_.out(g.nbc, M, TM, K, g.cap != 0, TN);
        const StatsArgs a{g.a, g.nbc, g.offa, M, K, g.sam, g.sak, bm, g.places, g.np, g.sB, g.ib, TN,
                          g.cap != 0, g.dt == DT_F64, o};
        stats_sides<T>(&a, 1, g.nt);
        g.A = side_of(o);
        g.times = o.times;
        g.sA = o.s;
        g.absA = o.absum;
    }
    const bool pre = g.dt == DT_F64, has_d = g.d != nullptr;
    const double alpha = g.alpha, a2 = alpha * alpha, aabs = std::fabs(alpha);
    STAGE("statsA");
    const i64 nz = has_d ? 10 : 5;
    // per c-batch buffers: predicted column sums, worst-case products, output sums
    double *predc = grown(bufs.predc, g.nbc * TM * N), *tcol = grown(bufs.tcol, g.cap ? g.nbc * TM * N : 0),
           *trow = grown(bufs.trow, g.cap ? g.nbc * M * TN : 0), *colz = grown(bufs.colz, g.nbc * TM * N * nz),
           *rowz = grown(bufs.rowz, g.nbc * M * TN * nz);
    uint8_t* anynf = grown(bufs.anynf, g.nbc * TM * TN);
    std::fill(anynf, anynf + g.nbc * TM * TN, 0);
    // the thin products: across batches when there are several, else within the one
    // (no nested parallel regions: libgomp would start a fresh team of threads for each)
    auto thin_products = [&](i64 b, int nt) {
        i64 bb = g.ib[b];
        const double* fB = g.B.e + bb * N;
        thin_t<T>((const T*)g.b + g.offb[b], K, N, g.sbk, g.sbn, g.sA + b * TM * K, TM, fB, false, pre,
                  nt, predc + b * TM * N);
        if (g.cap) {
            thin_t<T>((const T*)g.b + g.offb[b], K, N, g.sbk, g.sbn, g.absA + b * TM * K, TM, fB, true,
                      pre, nt, tcol + b * TM * N);
            // t_row: (|a| 2^-e) @ absum_B^T, rows of A: (M, TN)
            const T* a = (const T*)g.a + g.offa[b];
            const double* eA = g.A.e + b * M;
            const double* aB = g.absB + bb * TN * K;
            if (g.sak == 1 && TN < 4 && !pre) {    // contiguous rows: four rows at a time
                std::vector<double> sca(M);
                for (i64 i = 0; i < M; i++) sca[i] = pow2(-eA[i]);
                for (i64 q = 0; q < TN; q++)
                    row_dots<true>(a, g.sam, M, aB + q * K, K, sca.data(), &trow[b * M * TN + q], TN);
                return;
            }
            std::vector<double> row(K + 4);
            for (i64 i = 0; i < M; i++) {
                const double sc = pow2(-eA[i]);
                const T* ai = a + i * g.sam;
                i64 k = 0;
                if (g.sak == 1 && !pre)                // contiguous: four at a time
                    for (; k + 4 <= K; k += 4) store4(row.data() + k, abs4(load4(ai + k)));
                for (; k < K; k++) {
                    double v = std::fabs(cvt(ai[k * g.sak]));
                    row[k] = pre ? v * sc : v;
                }
                dots(row.data(), aB, TN, K, pre ? 1.0 : sc, &trow[(b * M + i) * TN], 1);
            }
        }
    };
    if (g.nbc > 1) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads_for(g.nt, (double)g.nbc * TM * K * N))
        for (i64 b = 0; b < g.nbc; b++) thin_products(b, 1);
    } else {
        thin_products(0, g.nt);
    }
    STAGE("thin");
    // one pass over C (and the addend), tile by tile: column sums per block of rows, row sums per
    // block of columns. A tile row whose sums are finite takes the vectorised path; one with a
    // non-finite element (or an overflowing square) is summed again element by element,
    // non-finite values counted, not added.
    const i64 jobs = g.nbc * TM, tiles = jobs * TN;
    const bool pf = g.scn == 1 && g.nbc * M * N * (i64)sizeof(T) >= PF_BYTES;
    // one tile's column accumulators, one array per sum (C's five, then the addend's five)
    // (C's and the addend's values of the last four rows: a clean row's column sums wait for
    // three more clean rows, and the four are added in one pass over the accumulators)
    struct CBufs { std::vector<double> cz, scol, segs, zcs, zr; };
    // (tile by tile: a product of one or two rows of tiles still spreads over the threads)
    parallel_for(threads_for(g.nt, (double)g.nbc * M * N), tiles,
                 [&] { return CBufs{std::vector<double>(bn * nz), std::vector<double>(bn),
                                    std::vector<double>(8 * bn), std::vector<double>(8 * bn),
                                    std::vector<double>(bn)}; },
                 [&](i64 tile, CBufs& cb) {
            std::vector<double>&cz = cb.cz, &scol = cb.scol, &segs = cb.segs, &zcs = cb.zcs, &zr = cb.zr;
            const i64 job = tile / TN, q = tile % TN;
            i64 b = job / TM, p = job % TM, bb = g.ib[b];
            const T* c = (const T*)g.c + g.offc[b];
            const double* d = has_d ? g.d + g.offd[b] : nullptr;
            const double *eA = g.A.e + b * M, *EA = g.A.E + b * TM, *fB = g.B.e + bb * N, *FB = g.B.E + bb * TN;
            const i64 i0 = p * bm, i1 = std::min(M, i0 + bm);
            {
                const i64 j0 = q * bn, w = std::min(N, j0 + bn) - j0;
                std::fill(cz.begin(), cz.end(), 0.0);
                // float64 C is scaled as it is read, by 2^x in two factors where x passes
                // POW2_SPLIT on either side (pow2_hi, pow2_lo; reference._scaled)
                bool split = false;
                for (i64 j = 0; j < w; j++) {
                    const double x = -(EA[p] + fB[j0 + j]);
                    scol[j] = pow2_hi(x);
                    split |= pre && x > POW2_SPLIT;
                }
                for (i64 i = i0; pre && i < i1; i++) split |= -(eA[i] + FB[q]) > POW2_SPLIT;
                std::vector<double> scol2(split ? w : 0);
                for (i64 j = 0; split && j < w; j++) scol2[j] = pow2_lo(-(EA[p] + fB[j0 + j]));
                const double srow = pow2(-FB[q]);
                Pending pend[2];
                // an addend repeated down the rows (a bias), finite, summed unscaled: its row sums
                // are one segment's, taken once; its column sums nr times its values (below)
                double bias[3] = {0, 0, 0};
                bool one_row = false;
                if (has_d && g.sdm == 0 && !pre) {
                    double* seg = segs.data() + 4 * bn;        // the addend's first slot
                    for (i64 j = 0; j < w; j++) seg[j] = d[(j0 + j) * g.sdn];
                    load_sums<false>(seg, w, (double*)nullptr, bias[0], bias[1], bias[2]);
                    one_row = fin(bias[0]) && fin(bias[1]);
                }
                auto bias_row = [&](i64 i, double sr) {
                    double* z = &rowz[((b * M + i) * TN + q) * nz + 5];
                    z[0] = bias[0] * sr; z[1] = bias[1] * (sr * sr); z[2] = bias[2] * sr; z[3] = 0; z[4] = 0;
                };
                // four clean rows at a time straight from C where nothing else is summed per row
                // (float32 too: 0.96-0.99 of the time through the copy on a Xeon, the same on an EPYC)
                const bool fast = g.scn == 1 && !split &&
                                  (!has_d || (one_row && !pre));
                i64 slow_until = i0;         // a group with an unclean row: its four rows one by one
                for (i64 i = i0; i < i1; i++) {
                    const double ei = pow2(-eA[i]), sr = ei * srow;
                    if (fast && i >= slow_until && pend[0].n == 0 && i + 4 <= i1) {
                        const T* ci = c + i * g.scm + j0;
                        for (i64 r = 0; r < 4; r++)
                            if (pf && i + r + C_PF_AHEAD < i1) prefetch_run<1>(ci + (r + C_PF_AHEAD) * g.scm, w);
                        double rs[4][4], s4[4];
                        for (i64 r = 0; r < 4; r++) s4[r] = pow2(-eA[i + r]) * srow;
                        double* z0 = cz.data();
                        if (rows4(ci, g.scm, w, s4, scol.data(), g.tiny, z0, z0 + bn, z0 + 2 * bn, z0 + 4 * bn,
                                  rs)) {
                            for (i64 r = 0; r < 4; r++) {
                                const double f = pre ? 1.0 : s4[r];
                                if (one_row) bias_row(i + r, s4[r]);
                                double* z = &rowz[((b * M + i + r) * TN + q) * nz];
                                z[0] = rs[r][0] * f; z[1] = rs[r][1] * (f * f); z[2] = rs[r][2] * f;
                                z[3] = 0; z[4] = rs[r][3];
                            }
                            i += 3;
                            continue;
                        }
                        slow_until = i + 4;
                    }
                    if (one_row) bias_row(i, sr);
                    for (int src = 0; src < (has_d && !one_row ? 2 : 1); src++) {
                        double* seg = segs.data() + (src * 4 + i % 4) * bn;
                        double* zc = zcs.data() + (src * 4 + i % 4) * bn;
                        double s1 = 0, s2 = 0, sa = 0, ns = 0, nf = 0;
                        bool summed = false;
                        if (src == 0) {
                            const T* ci = c + i * g.scm + j0 * g.scn;
                            if (pf && i + C_PF_AHEAD < i1) prefetch_run<1>(ci + C_PF_AHEAD * g.scm, w);
                            if (g.scn == 1 && !pre) {
                                load_sums<true>(ci, w, seg, s1, s2, sa);
                                summed = true;
                            } else {
                                for (i64 j = 0; j < w; j++) seg[j] = cvt(ci[j * g.scn]);
                            }
                        } else {
                            const double* di = d + i * g.sdm + j0 * g.sdn;
                            for (i64 j = 0; j < w; j++) seg[j] = di[j * g.sdn];
                        }
                        const double tiny = src ? 0.0 : g.tiny;
                        double* z0 = cz.data() + src * 5 * bn;
                        // the values as each side sums them (float64: scaled first)
                        const double *vc = seg, *vr = seg;
                        if (pre && split) {               // scaled in two factors (above)
                            const double x = -(eA[i] + FB[q]), r1 = pow2_hi(x), r2 = pow2_lo(x);
                            for (i64 j = 0; j < w; j++) {
                                zc[j] = seg[j] * scol[j] * scol2[j];
                                zr[j] = seg[j] * r1 * r2;
                            }
                            vc = zc;
                            vr = zr.data();
                        } else if (pre) {
                            for (i64 j = 0; j < w; j++) {
                                zc[j] = seg[j] * scol[j];
                                zr[j] = seg[j] * sr;
                            }
                            vc = zc;
                            vr = zr.data();
                        }
                        if (!summed) load_sums<false>(vr, w, (double*)nullptr, s1, s2, sa);
                        if (tiny > 0) {
#pragma omp simd reduction(+ : ns)
                            for (i64 j = 0; j < w; j++) ns += std::fabs(vr[j]) < tiny ? 1.0 : 0.0;
                        }
                        double *c1 = z0, *c2 = z0 + bn, *ca = z0 + 2 * bn, *cn = z0 + 3 * bn, *cs = z0 + 4 * bn;
                        if (fin(s2) && fin(s1)) {
                            pend[src].row[pend[src].n++] = vc;
                            if (pend[src].n == 4) pend[src].add(w, tiny, c1, c2, ca, cs);
                        } else {                          // exactly, element by element
                            pend[src].add(w, tiny, c1, c2, ca, cs);     // (their buffers are reused)
                            Acc r;
                            for (i64 j = 0; j < w; j++) {
                                add(r, vr[j], seg[j], tiny);
                                Acc a;
                                add(a, vc[j], seg[j], tiny);
                                c1[j] += a.s1; c2[j] += a.s2; ca[j] += a.sa; cn[j] += a.nf; cs[j] += a.ns;
                            }
                            s1 = r.s1; s2 = r.s2; sa = r.sa; nf = r.nf; ns = r.ns;
                            if (nf > 0 && src == 0) anynf[tile] = 1;
                        }
                        double f = pre ? 1.0 : sr;
                        double* z = &rowz[((b * M + i) * TN + q) * nz + src * 5];
                        z[0] = s1 * f; z[1] = s2 * (f * f); z[2] = sa * f; z[3] = nf; z[4] = ns;
                    }
                }
                if (one_row) {
                    double* z0 = cz.data() + 5 * bn;
                    const double r = (double)(i1 - i0), *seg = segs.data() + 4 * bn;
                    for (i64 j = 0; j < w; j++) {
                        const double v = seg[j];
                        z0[j] = r * v;
                        z0[bn + j] = r * sq_capped(v);
                        z0[2 * bn + j] = r * std::fabs(v);
                    }
                }
                for (int src = 0; src < (has_d ? 2 : 1); src++) {
                    double* z0 = cz.data() + src * 5 * bn;
                    pend[src].add(w, src ? 0.0 : g.tiny, z0, z0 + bn, z0 + 2 * bn, z0 + 4 * bn);
                }
                for (i64 src = 0; src < (has_d ? 2 : 1); src++) {
                    const double* z0 = cz.data() + src * 5 * bn;
                    for (i64 j = 0; j < w; j++) {
                        double f = pre ? 1.0 : scol[j];
                        double* z = &colz[((b * TM + p) * N + j0 + j) * nz + src * 5];
                        z[0] = z0[j] * f; z[1] = z0[bn + j] * (f * f); z[2] = z0[2 * bn + j] * f;
                        z[3] = z0[3 * bn + j]; z[4] = z0[4 * bn + j];
                    }
                }
            }
        }, true);
    STAGE("csum");
    // B's blocks that hold a low-entropy column
    const i64 nbb = g.nbb;
    std::vector<uint8_t> blowq(nbb * TN, 0);
    for (i64 bb = 0; bb < nbb; bb++)
        for (i64 q = 0; q < TN; q++)
            for (i64 j = q * bn; j < std::min(N, (q + 1) * bn); j++) blowq[bb * TN + q] |= g.B.low[bb * N + j];
    bool any_nf = false;
    for (i64 j = 0; j < tiles; j++) any_nf |= anynf[j] != 0;
    const bool half = g.tiny > 0;
    // residuals and thresholds of n <= 4 sums of one side (the lanes beyond n repeat the last,
    // not stored): the sums at o[l] (their output sums in zs, predictions, bounds and results
    // indexed so), their second side's rows y[l] of ys; the first side's statistics shared
    // (x: x1, xinf, xs1, xsinf times alpha^2; nu, its exponent ex, its low-entropy flag)
    auto four = [&](const double* coef, const double* zs, const double* preds, const double* ts,
                    double* res_out, double* thr_out, const i64* o, const Side& ys, const i64* y, int n,
                    const double* x, double nu, double ex, bool xlow, double eta) {
        auto at = [&](const double* v, const i64* ix) { return (v4d){v[ix[0]], v[ix[1]], v[ix[2]], v[ix[3]]}; };
        auto lane = [&](int f) {
            return (v4d){zs[o[0] * nz + f], zs[o[1] * nz + f], zs[o[2] * nz + f], zs[o[3] * nz + f]};
        };
        v4d pred = at(preds, o), t = g.cap ? at(ts, o) : splat(0.0);
        if (alpha != 1) { pred *= alpha; t *= aabs; }
        const v4d s1 = lane(0);
        const v4d res = has_d ? s1 - pred - lane(5) : s1 - pred;
        m4 low = (m4)splat(0.0);
        if (xlow)
            for (int l = 0; l < 4; l++) low[l] = ys.low[y[l]] ? -1 : 0;
        const v4d thr = threshold4(coef, s1, lane(1), lane(2), pred, x[0], x[1], x[2], x[3], at(ys.r1, y),
                                   at(ys.rinf, y), nu, low, ex, at(ys.e, y), has_d,
                                   has_d ? lane(6) : splat(0.0), has_d ? lane(7) : splat(0.0), g.cap != 0, t,
                                   half ? lane(4) : splat(coef[BS]), eta);
        for (int l = 0; l < n; l++) {
            res_out[o[l]] = res[l];
            thr_out[o[l]] = thr[l];
        }
    };
    // thresholds, ratios and the tile records
    parallel_for(threads_for(g.nt, (double)g.nbc * (M * TN + TM * N) * 20), jobs,
                 [&] { return std::vector<double>(TN); }, [&](i64 job, std::vector<double>& eta_r) {
            i64 b = job / TM, p = job % TM, bb = g.ib[b];
            const i64 i0 = p * bm, i1 = std::min(M, i0 + bm);
            // A's block p and rows; B's columns and blocks
            const double *eA = g.A.e + b * M, *EA = g.A.E + b * TM, *fB = g.B.e + bb * N, *FB = g.B.E + bb * TN;
            bool a_fin = true, a_low = false;
            for (i64 i = i0; i < i1; i++) {
                a_fin &= g.A.finite[b * M + i] != 0;
                a_low |= g.A.low[b * M + i] != 0;
            }
            const i64 pa = b * TM + p;
            const double eta_c = eta_of(g.coef_c, EA[p]);
            for (i64 q = 0; q < TN; q++) eta_r[q] = eta_of(g.coef_r, FB[q]);
            const double xa[4] = {g.A.x1[pa] * a2, g.A.xinf[pa] * a2, g.A.xs1[pa] * a2, g.A.xsinf[pa] * a2};
            double* rcp = g.res_c + (b * TM + p) * N;
            double* tcp = g.thr_c + (b * TM + p) * N;
            // column sums of block p (all columns), four at a time
            for (i64 j = 0; j < N; j += 4) {
                const int n = (int)std::min<i64>(4, N - j);
                i64 o[4], y[4];
                for (int l = 0; l < 4; l++) {
                    y[l] = bb * N + j + std::min(l, n - 1);
                    o[l] = (b * TM + p) * N + j + std::min(l, n - 1);
                }
                four(g.coef_c, colz, predc, tcol, g.res_c, g.thr_c, o, g.B, y, n, xa, g.A.nu[pa], EA[p],
                     a_low, eta_c);
            }
            // row sums of the rows of block p, per block of columns: four rows at a time
            for (i64 q = 0; q < TN; q++) {
                const i64 qb = bb * TN + q;
                const double xb[4] = {g.B.x1[qb] * a2, g.B.xinf[qb] * a2, g.B.xs1[qb] * a2, g.B.xsinf[qb] * a2};
                for (i64 i = i0; i < i1; i += 4) {
                    const int n = (int)std::min<i64>(4, i1 - i);
                    i64 o[4], y[4];
                    for (int l = 0; l < 4; l++) {
                        y[l] = b * M + i + std::min(l, n - 1);
                        o[l] = y[l] * TN + q;
                    }
                    four(g.coef_r, rowz, g.times, trow, g.res_r, g.thr_r, o, g.A, y, n, xb, g.B.nu[qb], FB[q],
                         blowq[bb * TN + q] != 0, eta_r[q]);
                }
            }
            // row norms of A's block (the overflow bound): taken where a tile's C is not finite
            double pa_max = -1;
            for (i64 q = 0; q < TN; q++) {
                const i64 j0 = q * bn, j1 = std::min(N, j0 + bn);
                bool b_fin = true;
                for (i64 j = j0; j < j1; j++) b_fin &= g.B.finite[bb * N + j] != 0;
                bool inputs_ok = a_fin && b_fin, thr_ok = true, c_bad = false, fault = false;
                double pkb = 0, dmax = 0;
                for (i64 j = j0; j < j1; j++) {
                    const double* z = &colz[((b * TM + p) * N + j) * nz];
                    if (has_d && z[8] != 0) inputs_ok = false;
                    thr_ok &= fin(tcp[j]);
                    c_bad |= z[3] > 0;
                    if (any_nf && z[3] == 1) {
                        double lim = g.dtmax * pow2(-(EA[p] + fB[j]));
                        fault |= std::fabs(rcp[j]) + tcp[j] < lim;
                    }
                }
                for (i64 i = i0; i < i1; i++) {
                    const double* z = &rowz[((b * M + i) * TN + q) * nz];
                    double thr = g.thr_r[(b * M + i) * TN + q];
                    thr_ok &= fin(thr);
                    c_bad |= z[3] > 0;
                    if (any_nf && z[3] == 1) {
                        double lim = g.dtmax * pow2(-(eA[i] + FB[q]));
                        fault |= std::fabs(g.res_r[(b * M + i) * TN + q]) + thr < lim;
                    }
                }
                double status = (inputs_ok && thr_ok) ? 0.0 : 1.0;
                // reference._peak: a bound of |C| over the tile from the operands' norms
                auto tile_peak = [&]() {
                    if (pa_max < 0) {
                        pa_max = 0;
                        for (i64 i = i0; i < i1; i++)
                            pa_max = nmax(pa_max, std::sqrt(g.A.r1[b * M + i]) * pow2(eA[i]));
                    }
                    for (i64 j = j0; j < j1; j++) pkb = nmax(pkb, std::sqrt(g.B.r1[bb * N + j]) * pow2(fB[j]));
                    double peak = pa_max * pkb * aabs;
                    if (has_d) {
                        const double* d = g.d + g.offd[b];
                        for (i64 i = i0; i < i1; i++)
                            for (i64 j = j0; j < j1; j++) dmax = nmax(dmax, std::fabs(d[i * g.sdm + j * g.sdn]));
                        peak = peak + dmax;
                    }
                    return peak;
                };
                if (any_nf && c_bad) {
                    fault |= tile_peak() < g.dtmax;
                    status = (inputs_ok && fault) ? 2.0 : 1.0;
                } else if (inputs_ok && !thr_ok) {
                    // thresholds that overflow over a finite C (reference._beyond): checked after
                    // all where a sum of |C| exceeds twice what the operands allow
                    const double peak = tile_peak();
                    bool beyond = false;
                    for (i64 j = j0; j < j1; j++) {
                        const double bound = 2.0 * (double)bm * peak * pow2(-(EA[p] + fB[j]));
                        beyond |= fin(bound) && !(colz[((b * TM + p) * N + j) * nz + 2] <= bound);
                    }
                    for (i64 i = i0; i < i1; i++) {
                        const double bound = 2.0 * (double)bn * peak * pow2(-(eA[i] + FB[q]));
                        beyond |= fin(bound) && !(rowz[((b * M + i) * TN + q) * nz + 2] <= bound);
                    }
                    if (beyond) status = 0.0;
                }
                const bool keep = status != 1.0;
                // column sums of the tile
                double cw = 0, cf = 0, cidx = -1, cres = 0, cthr = 1;
                i64 arg = 0;
                for (i64 j = j0; j < j0 + bn; j++) {
                    double r = 0, rs = 0, th = 1;
                    if (j < j1) {
                        const double* z = &colz[((b * TM + p) * N + j) * nz];
                        double sc = pow2(EA[p] + fB[j]);
                        r = rcp[j] / tcp[j];
                        if (z[3] > 0) r = INF;
                        if (r != r) r = INF;
                        if (!keep) r = 0;
                        rs = rcp[j] * sc;
                        th = tcp[j] * sc;
                        g.detail_c[(b * TM + p) * N + j] = (float)r;
                    }
                    double m = std::fabs(r);
                    if (j == j0 || m > cw) { cw = m; arg = j; cres = rs; cthr = th; }
                    cf += m > 1;
                }
                if (cf > 0) cidx = (double)arg;
                // row sums of the tile
                double rw = 0, rf = 0, ridx = -1, rres = 0, rthr = 1;
                for (i64 i = i0; i < i0 + bm; i++) {
                    double r = 0, rs = 0, th = 1;
                    if (i < i1) {
                        const i64 o = (b * M + i) * TN + q;
                        double sc = pow2(eA[i] + FB[q]);
                        r = g.res_r[o] / g.thr_r[o];
                        if (rowz[o * nz + 3] > 0) r = INF;
                        if (r != r) r = INF;
                        if (!keep) r = 0;
                        rs = g.res_r[o] * sc;
                        th = g.thr_r[o] * sc;
                        g.detail_r[o] = (float)r;
                    }
                    double m = std::fabs(r);
                    if (i == i0 || m > rw) { rw = m; arg = i; rres = rs; rthr = th; }
                    rf += m > 1;
                }
                if (rf > 0) ridx = (double)arg;
                float* v = g.verdict + ((b * TM + p) * TN + q) * 9;
                bool use_col = cf > 0;
                v[0] = (float)rw; v[1] = (float)rf; v[2] = (float)ridx;
                v[3] = (float)cw; v[4] = (float)cf; v[5] = (float)cidx;
                v[6] = (float)(use_col ? cres : rres);
                v[7] = (float)(use_col ? cthr : rthr);
                v[8] = (float)status;
            }
        }, true);
    STAGE("thr");
    if (!g.units) {
        STAGE(".units");
        return;
    }
    // residuals and thresholds in C's units
    parallel_for(threads_for(g.nt, (double)jobs * N), jobs, [] { return 0; }, [&](i64 job, int&) {
        i64 b = job / TM, p = job % TM, bb = g.ib[b];
        const double *eA = g.A.e + b * M, *EA = g.A.E + b * TM, *fB = g.B.e + bb * N, *FB = g.B.E + bb * TN;
        for (i64 j = 0; j < N; j++) {
            double sc = pow2(EA[p] + fB[j]);
            g.res_c[job * N + j] *= sc;
            g.thr_c[job * N + j] *= sc;
        }
        for (i64 i = p * bm; i < std::min(M, (p + 1) * bm); i++)
            for (i64 q = 0; q < TN; q++) {
                double sc = pow2(eA[i] + FB[q]);
                g.res_r[(b * M + i) * TN + q] *= sc;
                g.thr_r[(b * M + i) * TN + q] *= sc;
            }
    });
    STAGE(".units");
}

// Many small matrices with their own B (a batch of attention products): one parallel region over
// the batch, each matrix's whole check on one thread (its stages one after another, its data in
// that core's caches), instead of a region per stage spread across the batch, whose set-up and
// waiting cost more than a 64^3 matrix's stages. Each matrix's results are the same either way
// (every stage's job is one block of one matrix).
static bool by_matrix(const CheckArgs& g) {
    return g.nt > 1 && g.nbc >= 2 * g.nt && g.nbb == g.nbc && g.B.e == nullptr &&
           footprint(g) / g.nbc <= BATCH_REUSE_DOUBLES && threads_for(g.nt, (double)g.nbc * g.M * g.N * g.K) > 1;
}

template <typename T>
static void check_batches(const CheckArgs& g) {
    static const i64 zero = 0;
    const i64 M = g.M, N = g.N, TM = (M + g.bm - 1) / g.bm, TN = (N + g.bn - 1) / g.bn;
    parallel_for(g.nt, g.nbc, [] { return 0; }, [&](i64 b, int&) {
        CheckArgs h = g;
        h.nbc = h.nbb = 1;
        h.nt = 1;
        h.reuse = true;
        h.offc = g.offc + b; h.offa = g.offa + b; h.offb = g.offb + b; h.offbb = g.offbb + g.ib[b];
        if (g.d != nullptr) h.offd = g.offd + b;
        h.ib = &zero;
        h.verdict = g.verdict + b * TM * TN * 9;
        h.detail_r = g.detail_r + b * M * TN; h.detail_c = g.detail_c + b * TM * N;
        h.res_c = g.res_c + b * TM * N; h.thr_c = g.thr_c + b * TM * N;
        h.res_r = g.res_r + b * M * TN; h.thr_r = g.thr_r + b * M * TN;
        check_t<T>(h);
    }, true);
}

// layout.summary of the verdict: tiles alarmed (a ratio above 1, or NONFINITE), unverified, all
// tiles, the worst ratio; from the float32 fields, as the policy reads them
static void summarize(const CheckArgs& g, double* out) {
    const i64 n = g.nbc * ((g.M + g.bm - 1) / g.bm) * ((g.N + g.bn - 1) / g.bn);
    double alarmed = 0, unverified = 0, worst = 0;
    for (i64 t = 0; t < n; t++) {
        const float* v = g.verdict + t * 9;
        alarmed += (v[0] > 1 || v[3] > 1 || v[8] == 2.0f) ? 1 : 0;
        unverified += v[8] == 1.0f ? 1 : 0;
        const double w = v[0] > v[3] ? v[0] : v[3];
        worst = (t == 0 || w > worst) ? w : worst;
    }
    out[0] = alarmed; out[1] = unverified; out[2] = (double)n; out[3] = worst;
}

// dims: nbc, nbb, M, N, K, bm, bn, strides of C (m, n), A (m, k), B (k, n), the addend (m, n), dtype,
// cap, threads, number of sampled places. ptrs: offsets of C, A, B per c-batch, of B per b-batch,
// of the addend; ib; places; a, b, c, addend; B's kept statistics (11 fields, then s and absum;
// all null: computed here); coefficients (col, row). scal: alpha, the half type's smallest normal
// (0: not a half type), the dtype's largest value. outs: verdict, row and column ratios, then the
// residuals and thresholds of the column and the row sums (null: not returned), the verdict's
// summary (null: not returned).
extern "C" int abft_check(const i64* dims, const void* const* ptrs, const double* scal, void* const* outs) {
    CheckArgs g;
    g.nbc = dims[0]; g.nbb = dims[1]; g.M = dims[2]; g.N = dims[3]; g.K = dims[4]; g.bm = dims[5]; g.bn = dims[6];
    g.scm = dims[7]; g.scn = dims[8]; g.sam = dims[9]; g.sak = dims[10]; g.sbk = dims[11]; g.sbn = dims[12];
    g.sdm = dims[13]; g.sdn = dims[14]; g.dt = (int)dims[15]; g.cap = (int)dims[16]; g.nt = (int)dims[17];
    g.np = dims[18];
    if (g.np > 64) return 2;
    int i = 0;
    g.offc = (const i64*)ptrs[i++]; g.offa = (const i64*)ptrs[i++]; g.offb = (const i64*)ptrs[i++];
    g.offbb = (const i64*)ptrs[i++]; g.offd = (const i64*)ptrs[i++]; g.ib = (const i64*)ptrs[i++];
    g.places = (const i64*)ptrs[i++];
    g.a = ptrs[i++]; g.b = ptrs[i++]; g.c = ptrs[i++]; g.d = (const double*)ptrs[i++];
    Side* s = &g.B;
    s->e = (const double*)ptrs[i++]; s->r1 = (const double*)ptrs[i++]; s->rinf = (const double*)ptrs[i++];
    s->E = (const double*)ptrs[i++]; s->x1 = (const double*)ptrs[i++]; s->xinf = (const double*)ptrs[i++];
    s->xs1 = (const double*)ptrs[i++]; s->xsinf = (const double*)ptrs[i++]; s->nu = (const double*)ptrs[i++];
    s->finite = (const uint8_t*)ptrs[i++]; s->low = (const uint8_t*)ptrs[i++];
    g.sB = (const double*)ptrs[i++]; g.absB = (const double*)ptrs[i++];
    g.coef_c = (const double*)ptrs[i++]; g.coef_r = (const double*)ptrs[i++];
    g.alpha = scal[0]; g.tiny = scal[1]; g.dtmax = scal[2];
    g.verdict = (float*)outs[0]; g.detail_r = (float*)outs[1]; g.detail_c = (float*)outs[2];
    // the residuals and thresholds: the caller's (then in C's units), else scratch here
    thread_local std::vector<double> kept;
    std::vector<double> fresh;
    g.units = outs[3] != nullptr;
    g.reuse = footprint(g) <= REUSE_DOUBLES;
    if (g.units) {
        g.res_c = (double*)outs[3]; g.thr_c = (double*)outs[4]; g.res_r = (double*)outs[5]; g.thr_r = (double*)outs[6];
    } else {
        const i64 nc = g.nbc * ((g.M + g.bm - 1) / g.bm) * g.N, nr = g.nbc * g.M * ((g.N + g.bn - 1) / g.bn);
        g.res_c = grown(g.reuse ? kept : fresh, 2 * (nc + nr));
        g.thr_c = g.res_c + nc; g.res_r = g.thr_c + nc; g.thr_r = g.res_r + nr;
    }
    if (by_matrix(g)) {
        DISPATCH(g.dt, check_batches, g);
    } else {
        DISPATCH(g.dt, check_t, g);
    }
    if (outs[7] != nullptr) summarize(g, (double*)outs[7]);
    return 0;
}

// abft.rest's fingerprint of a tensor's bits: per block of `block` (at most 256) words, three exact
// sums: the words, the words times their 1-based index k in the block, and times f(k) = k^2 mod
// 4093 + 1 (rest.fingerprint's torch version is the oracle). Every term and partial sum is an
// integer below 2^53 (|word| < 2^31, k <= 256, f(k) <= 4093), so float64 sums are exact in any
// order. `words`: n contiguous 16- or 32-bit signed words (word_bytes 2 or 4); `out`: (blocks, 3)
// int64. One read of the words; blocks spread over `threads`.
template <typename W>
static void fingerprint_blocks(const W* w, i64 n, i64 block, i64* out, int threads) {
    const i64 nb = (n + block - 1) / block;
    double kd[256], fk[256];                       // k and f(k) as doubles (no int64 -> double
    for (i64 k = 1; k <= block; ++k) {             // conversion in the loop: AVX2 has none)
        kd[k - 1] = (double)k;
        fk[k - 1] = (double)(k * k % 4093 + 1);
    }
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && n >= (1 << 16))
    for (i64 b = 0; b < nb; ++b) {
        const i64 lo = b * block, m = std::min(block, n - lo);
        const W* x = w + lo;
        double a0[8] = {0}, a1[8] = {0}, a2[8] = {0};      // eight lanes: no reduction order
        i64 i = 0;                                          // to keep, so the loop vectorizes
        for (; i + 8 <= m; i += 8)
            for (int j = 0; j < 8; ++j) {
                const double v = (double)x[i + j];
                a0[j] += v;
                a1[j] += v * kd[i + j];
                a2[j] += v * fk[i + j];
            }
        for (; i < m; ++i) {
            const double v = (double)x[i];
            a0[0] += v;
            a1[0] += v * kd[i];
            a2[0] += v * fk[i];
        }
        double s0 = 0, s1 = 0, s2 = 0;
        for (int j = 0; j < 8; ++j) {
            s0 += a0[j];
            s1 += a1[j];
            s2 += a2[j];
        }
        out[3 * b] = (i64)s0;
        out[3 * b + 1] = (i64)s1;
        out[3 * b + 2] = (i64)s2;
    }
}

extern "C" int abft_fingerprint(const void* words, i64 word_bytes, i64 n, i64 block, i64* out,
                                i64 threads) {
    if (block < 1 || block > 256 || n < 0) return 2;
    if (word_bytes == 2) fingerprint_blocks((const int16_t*)words, n, block, out, (int)threads);
    else if (word_bytes == 4) fingerprint_blocks((const int32_t*)words, n, block, out, (int)threads);
    else return 2;
    return 0;
}
