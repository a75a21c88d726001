// One decode step of a Llama-family model for a batch of sequences, as a single call: the whole T = 1
// forward of each (embedding row, per layer RMSNorm -> QKV -> rotary -> KV cache write -> attention -> O ->
// residual -> RMSNorm -> gate/up -> SiLU * up -> down -> residual, then the final norm and the LM head).
// Every weight is read once for the whole batch: decode is memory-bound, so B sequences cost little more
// than one. Each sequence's arithmetic is the same whatever else is in the batch (same order of sums),
// so its tokens do not depend on its neighbours.
//
// Why: a decode step moves every weight once and does little arithmetic per byte, so it should run at
// memory bandwidth. In eager PyTorch it does not: ~25 small ops per layer each pay dispatch and thread
// start-up, which on 2 cores was more than half of the step. Here the small ops are plain loops on one
// thread and only the matrix-vector products use the OpenMP team (torch's own libgomp, already loaded).
//
// Layouts (made by engine/kernels/fused.py from the LeanLlama weights):
//   linear weights output-major W[out][in], fp32, or int8 with one fp32 scale per row (with AVX-512, int8
//   rows packed 16 at a time: ps_pack_int8);
//   q/k rows paired per head, (x_i, x_{i+D/2}) adjacent, so the rotary embedding is a complex product;
//   kv pool [layers][2][kv_heads][slots][head_dim] fp32, the same tensor the PyTorch path fills; a
//   sequence's position p lives in slot table[p / block_size] * block_size + p % block_size (paged).
// Also prefill's attention (ps_prefill_attention, below), which reads the paged pool in place.
// No torch headers: built with g++ in about a second and called through ctypes.
#include <omp.h>
#include <sched.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

namespace {

// exp(x) for the softmaxes and SiLU, written so that loops over it vectorize (the C library's expf
// is a scalar call without -ffast-math): 2^n * e^r with |r| <= ln2/2, a degree-6 polynomial for e^r.
// Relative error ~2e-7; x below -87 flushes to 0, which only ever meets probabilities and gates.
#pragma omp declare simd
inline float fast_exp(float x) {
    x = std::min(std::max(x, -87.0f), 88.0f);
    const float n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;  // round to nearest (nearbyint is a call)
    const float r = x - n * 0.693147181f;
    float p = 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t bits;
    std::memcpy(&bits, &p, sizeof bits);
    bits += int32_t(n) << 23;  // multiply by 2^n through the exponent field
    std::memcpy(&p, &bits, sizeof bits);
    return x <= -87.0f ? 0.0f : p;
}

struct Linear {
    const void *weight;  // float or int8_t [out][in], or packed int8 rows (ps_pack_int8)
    const float *scale;  // [out] for int8, else null
    const float *bias;   // [out] or null
};

struct Dims {
    int64_t layers, heads, kv_heads, head_dim, hidden, intermediate, vocab, num_slots, block_size, is_int8, threads,
        split_kv, kv_format;  // kv_format: the KV cache's, kF32, kF16 or kQ8
};

// The sequences of one step: token, position and block table of each.
struct Batch {
    int64_t size;
    const int64_t *tokens, *positions, *tables;
    int64_t table_stride;  // entries per block table row

    int64_t slot(const Dims &d, int64_t b, int64_t pos) const {
        return tables[b * table_stride + pos / d.block_size] * d.block_size + pos % d.block_size;
    }
};

// Both number formats keep their weights output-major, W[out][in]: each output is one row's dot product
// with the input, a thread streams a contiguous range of rows, and each row, once in L1, serves every
// sequence of the batch (decode is memory-bound: this is what makes a batch cheap). Per output the sum
// runs in the same order whatever the batch, so a sequence's results do not depend on its neighbours.
typedef float Vec __attribute__((vector_size(32), aligned(4)));  // 8 floats; loads need no alignment
constexpr int64_t kVec = 8;
constexpr int64_t kMaxBatch = 4;  // sequences whose accumulators are held in registers at once
// How far ahead of the row being computed its weights are fetched: with a batch, a row takes long
// enough to compute that the hardware prefetcher alone left the loads waiting on memory (measured).
constexpr int64_t kPrefetchBytes = 16384;
// The weights ahead go to L2, not L1 (prefetcht1): 16 KB of them in a 32 KB L1 pushed out the batch's
// inputs, which every row reads again (four fp32 sequences of the FFN's down projection are 24 KB), so
// that four fp32 sequences' step took 25 ms against one's 15-17; with this 17 ms, and one int8 sequence's
// 4.9 -> 4.1 ms (AMD EPYC, AVX-512 and AVX2 builds, alternating; prefill unchanged within the noise).
inline void prefetch_weights(const void *p) { __builtin_prefetch(p, 0, 2); }

typedef float Vec16 __attribute__((vector_size(64), aligned(4)));  // 16 floats; unaligned loads

#if defined(__AVX512F__)
// out[i] = the sum of a[i]'s 16 lanes, for 16 vectors at once (45 shuffles and adds, not 16 x 15): per
// 128-bit quarter (0 + 2) + (1 + 3), then the quarters (0 + 2) + (1 + 3), the same order for every i.
inline Vec16 sums_of_16(const Vec16 a[16]) {
    __m512 pairs[8], fours[4];
    for (int i = 0; i < 8; i++) {
        const __m512 x = (__m512)a[2 * i], y = (__m512)a[2 * i + 1];
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
    }
    for (int i = 0; i < 4; i++) {
        const __m512 x = pairs[2 * i], y = pairs[2 * i + 1];
        fours[i] = _mm512_add_ps(_mm512_shuffle_ps(x, y, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(x, y, _MM_SHUFFLE(3, 2, 3, 2)));
    }
    const __m512 low = _mm512_add_ps(_mm512_shuffle_f32x4(fours[0], fours[1], 0x44),
                                     _mm512_shuffle_f32x4(fours[0], fours[1], 0xEE));
    const __m512 high = _mm512_add_ps(_mm512_shuffle_f32x4(fours[2], fours[3], 0x44),
                                      _mm512_shuffle_f32x4(fours[2], fours[3], 0xEE));
    return (Vec16)_mm512_add_ps(_mm512_shuffle_f32x4(low, high, 0x88), _mm512_shuffle_f32x4(low, high, 0xDD));
}
#endif

inline float sum_lanes(Vec v) {
    float total = 0.0f;
    for (int64_t i = 0; i < kVec; i++) total += v[i];
    return total;
}

// The same sum in halves, (0 + 4) + (2 + 6) + ((1 + 5) + (3 + 7)): three shuffles and three adds, where
// sum_lanes's chain of eight dependent adds held a decode step's attention up (one per head and position).
inline float sum_halves(Vec v) {
#if defined(__AVX__)
    const __m128 four = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
    const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
#else
    return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
#endif
}

// --- the KV cache's number formats: fp32; fp16 (half the bytes to read at long context, as llama.cpp's
// default f16 cache); or int8 with a scale per row (below). Keys and values are stored rounded to the
// format and read back as fp32; everything else stays fp32. fp16 needs the F16C instructions (x86-64-v3).
enum KvFormat { kF32 = 0, kF16 = 1, kQ8 = 2 };  // dims' kv_format
typedef uint16_t half;
#if defined(__F16C__)
constexpr bool kHasHalf = true;
inline Vec load8(const half *p) { return (Vec)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p))); }
inline float load1(const half *p) { return _cvtsh_ss(*p); }
inline void store_row(half *dst, const float *src, int64_t D) {
    for (int64_t i = 0; i < D; i += 8)
        _mm_storeu_si128(reinterpret_cast<__m128i *>(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#else
constexpr bool kHasHalf = false;  // ps_kv_formats says so: the caller keeps an fp32 cache
inline Vec load8(const half *) { return Vec{}; }
inline float load1(const half *) { return 0.0f; }
inline void store_row(half *, const float *, int64_t) {}
#endif
inline Vec load8(const float *p) { return *reinterpret_cast<const Vec *>(p); }
inline float load1(const float *p) { return *p; }
inline void store_row(float *dst, const float *src, int64_t D) { std::memcpy(dst, src, D * sizeof(float)); }

// int8: a row of D values kept as D int8 and, after them, the row's fp32 scale (its largest magnitude /
// 127): D + 4 bytes where fp32 takes 4 D, so a 64-wide head's keys take 68 bytes instead of 256.
typedef int8_t q8;
inline void store_row(q8 *dst, const float *src, int64_t D) {
    float top = 0.0f;
    for (int64_t i = 0; i < D; i++) top = std::max(top, std::fabs(src[i]));
    const float scale = top / 127.0f, inverse = top > 0.0f ? 127.0f / top : 0.0f;
    // nearest, ties to even (no multiply-add to contract into, unlike the 2^23 trick: kv_pool.quantize_rows
    // computes exactly this)
    for (int64_t i = 0; i < D; i++) dst[i] = q8(std::nearbyint(src[i] * inverse));
    std::memcpy(dst + D, &scale, sizeof scale);
}

// Elements of KV one stored row (a head's keys or values at one position) takes.
template <typename KV> constexpr int64_t row_size(int64_t D) { return D; }
template <> constexpr int64_t row_size<q8>(int64_t D) { return D + int64_t(sizeof(float)); }

// Reads one stored row back as fp32, 1 or 8 values at a time, before its scale: a row's value i is
// load1(i) * scale. The scale (1 but for int8) is applied once to a whole dot product or weight, not
// to every value; times 1.0f changes nothing, so fp32 and fp16 results are what they were without it.
template <typename KV>
struct RowReader {
    const KV *row;
    float scale = 1.0f;
    RowReader(const KV *row, int64_t) : row(row) {}
    float load1(int64_t i) const { return ::load1(row + i); }
    Vec load8(int64_t i) const { return ::load8(row + i); }
#if defined(__AVX512F__)
    Vec16 load16(int64_t i) const {
        if constexpr (std::is_same<KV, half>::value)
            return (Vec16)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(row + i)));
        else
            return *reinterpret_cast<const Vec16 *>(row + i);
    }
#endif
};

template <>
struct RowReader<q8> {
    const q8 *row;
    float scale;
    RowReader(const q8 *row, int64_t D) : row(row) { std::memcpy(&scale, row + D, sizeof scale); }
    float load1(int64_t i) const { return float(row[i]); }
    Vec load8(int64_t i) const {
#if defined(__AVX2__)
        const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i *>(row + i));
        return (Vec)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
#else
        Vec x;
        for (int j = 0; j < 8; j++) x[j] = float(row[i + j]);
        return x;
#endif
    }
#if defined(__AVX512F__)
    Vec16 load16(int64_t i) const {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i *>(row + i));
        return (Vec16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
    }
#endif
};

// --- fp32: out[b] = row . x_b, two accumulator chains per sequence --------------------------------------
template <int B>
void row_dots_f32(const float *x, int64_t in, const float *row, float *out) {
    Vec acc[B][2] = {};
    int64_t i = 0;
    for (; i + 2 * kVec <= in; i += 2 * kVec) {
        prefetch_weights(row + kPrefetchBytes / sizeof(float) + i);  // a later row, while this one computes
        const Vec w0 = *reinterpret_cast<const Vec *>(row + i), w1 = *reinterpret_cast<const Vec *>(row + i + kVec);
        for (int b = 0; b < B; b++) {
            acc[b][0] += *reinterpret_cast<const Vec *>(x + b * in + i) * w0;  // one FMA (-ffp-contract=fast)
            acc[b][1] += *reinterpret_cast<const Vec *>(x + b * in + i + kVec) * w1;
        }
    }
    for (int b = 0; b < B; b++) {
        float total = sum_lanes(acc[b][0] + acc[b][1]);
        for (int64_t k = i; k < in; k++) total += x[b * in + k] * row[k];
        out[b] = total;
    }
}

// y[b][r0:r1] = W[r0:r1, :] . x_b, W fp32 output-major [out][in].
void matvec_f32_rows(const float *x, int64_t n, const float *w, int64_t in, int64_t out, int64_t r0, int64_t r1,
                     float *y) {
    float dots[kMaxBatch];
    for (int64_t r = r0; r < r1; r++) {
        for (int64_t b0 = 0; b0 < n; b0 += kMaxBatch) {
            const int64_t count = std::min(kMaxBatch, n - b0);
            const float *xb = x + b0 * in, *row = w + r * in;
            switch (count) {
                case 1: row_dots_f32<1>(xb, in, row, dots); break;
                case 2: row_dots_f32<2>(xb, in, row, dots); break;
                case 3: row_dots_f32<3>(xb, in, row, dots); break;
                default: row_dots_f32<4>(xb, in, row, dots); break;
            }
            for (int64_t b = 0; b < count; b++) y[(b0 + b) * out + r] = dots[b];
        }
    }
}

// --- int8 x int8 -----------------------------------------------------------------------------------------
// x is quantized per step in blocks of 64 inputs, each with its own scale (like llama.cpp's Q8
// activations), so one outlier only coarsens its own block: each block's integer dot product is converted
// to float and scaled by the block's scale, the row's scale applied at the end. The integer products take
// unsigned x signed bytes (vpdpbusd, maddubs):
// - AVX-512 (VNNI): the weights are packed 16 rows at a time and kept as w + 128 (ps_pack_int8), x as
//   it is; each sum starts from -128 * sum(x) of the block, made once per token and block.
// - AVX-VNNI (256-bit): x is kept as x + 128, each sum starting from -128 * sum(w) of the row's block.
// - AVX2, scalar: x as |x| and the sign of x, moved onto the weight.
// Within a build every (row, token) sum takes the same steps, whichever batch, tile or prefill makes it.
// The batch is laid out block by block, [block][sequence][64], so that one pointer walks every sequence.
constexpr int64_t kBlock = 64;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PS_PACKED_ROWS 1
constexpr int64_t kRowGroup = 16;  // rows packed together (see packed_block_int8)
#else
constexpr int64_t kRowGroup = 0;  // rows as they are, output-major W[out][in]
#endif
#if defined(PS_PACKED_ROWS) || defined(__AVXVNNI__)
constexpr bool kKeepsSign = false;  // the unsigned operand (w + 128 or x + 128) carries the sign
#else
constexpr bool kKeepsSign = true;
#endif

struct QuantizedBatch {
    int64_t n = 0;
    std::vector<uint8_t> bytes;  // [block][n][64]: x (AVX-512: signed bytes), x + 128 (AVX-VNNI), or |x|
    std::vector<int8_t> sign;    // [block][n][64]: the sign of x (AVX2, scalar)
    std::vector<float> scale;    // [block][n]
    std::vector<int32_t> start;  // [block][n]: -128 * sum(x) (AVX-512, whose weights are w + 128)

    QuantizedBatch(int64_t n, int64_t in)
        : n(n), bytes(n * in), sign(kKeepsSign ? n * in : 0), scale(n * (in / kBlock)),
          start(kRowGroup ? n * (in / kBlock) : 0) {}

    // block k of sequence b, from its inputs xk [64]
    void quantize(int64_t k, int64_t b, const float *xk) {
        float top = 0.0f;
#pragma omp simd reduction(max : top)  // without it the compiler keeps this loop scalar
        for (int64_t i = 0; i < kBlock; i++) top = std::max(top, std::fabs(xk[i]));
        const float inverse = top > 0.0f ? 127.0f / top : 0.0f;
        scale[k * n + b] = top / 127.0f;
        uint8_t *out = bytes.data() + (k * n + b) * kBlock;
#if defined(PS_PACKED_ROWS)
        int32_t sum = 0;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < kBlock; i++) {
            const int v = int((xk[i] * inverse + 12582912.0f) - 12582912.0f);  // round to nearest even
            out[i] = uint8_t(int8_t(v));
            sum += v;
        }
        start[k * n + b] = -128 * sum;
#elif defined(__AVXVNNI__)
#pragma omp simd
        for (int64_t i = 0; i < kBlock; i++)
            out[i] = uint8_t(int((xk[i] * inverse + 12582912.0f) - 12582912.0f) + 128);  // round to nearest even
#elif defined(__AVX2__) && defined(__FMA__)
        int8_t *signs = sign.data() + (k * n + b) * kBlock;
        const __m256 times = _mm256_set1_ps(inverse), magic = _mm256_set1_ps(12582912.0f);
        const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleave
        for (int64_t i = 0; i < kBlock; i += 32) {
            __m256i v[4];
            for (int j = 0; j < 4; j++) {  // round to nearest even, as the scalar path below
                const __m256 x = _mm256_loadu_ps(xk + i + 8 * j);
                v[j] = _mm256_cvtps_epi32(_mm256_sub_ps(_mm256_fmadd_ps(x, times, magic), magic));
            }
            const __m256i bytes = _mm256_permutevar8x32_epi32(
                _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3])), order);
            _mm256_storeu_si256((__m256i *)(out + i), _mm256_abs_epi8(bytes));
            _mm256_storeu_si256((__m256i *)(signs + i), _mm256_sign_epi8(_mm256_set1_epi8(1), bytes));
        }
#else
        int8_t *signs = sign.data() + (k * n + b) * kBlock;
#pragma omp simd
        for (int64_t i = 0; i < kBlock; i++) {
            const float v = (xk[i] * inverse + 12582912.0f) - 12582912.0f;  // round to nearest even
            out[i] = uint8_t(std::fabs(v));
            signs[i] = int8_t(v > 0.0f ? 1 : v < 0.0f ? -1 : 0);
        }
#endif
    }
};

#if defined(PS_PACKED_ROWS)
// The packed layout: for each group of 16 rows and each 4 inputs, 64 bytes holding those 4 inputs of the
// 16 rows (row-major within), as w + 128; a group's in * 16 bytes are contiguous, rows past the end are
// w = 0. One vpdpbusd then adds 4 products to each of 16 rows' sums at once (lane i: row 16 g + i), the
// 16 rows' weights against 4 bytes of one token's x broadcast, so that a block's sums are whole in their
// lanes after 16 of them: converting and scaling the block takes one conversion and one multiply-add per
// 16 vpdpbusd. (With the rows as they are, a lane held a quarter of one row's block and the conversion
// came every 4 vpdpbusd. This layout made a prefill's matmuls 1.2-1.45x faster on an Intel Xeon, and
// through the engine pp512 19 % and tg128 17 % faster, alternating in one process.)

// y[b0 + t][16 (g + i) + lane] for the rows below r1: the 16 rows of groups g + i (i < R) against tokens
// b0 + t (t < T), over all of x. A sum's steps (blocks in order, each multiply-added into a float sum
// from 0, then times the row's scale) do not depend on R, T, the tile or the batch: a prefill's rows are a
// decode step's rows, bit for bit.
template <int R, int T>
inline void packed_block_int8(const QuantizedBatch &q, int64_t b0, const uint8_t *w, const float *scale, int64_t in,
                              int64_t out, int64_t g, int64_t r1, float *y) {
    const int64_t blocks = in / kBlock, n = q.n, group_bytes = in * kRowGroup;
    // the float sums in L1: the integer sums take the registers (the float sums there too spilled both,
    // and ran no faster than the rows as they are)
    alignas(64) float acc[R][T][kRowGroup] = {};
    const uint8_t *rows = w + g * group_bytes;
    for (int64_t k = 0; k < blocks; k++) {
        __m512i dot[R][T];
        for (int t = 0; t < T; t++) {
            const __m512i start = _mm512_set1_epi32(q.start[k * n + b0 + t]);
            for (int i = 0; i < R; i++) dot[i][t] = start;
        }
        const uint8_t *x = q.bytes.data() + (k * n + b0) * kBlock, *block = rows + k * kBlock * kRowGroup;
        for (int64_t step = 0; step < kBlock; step += 4) {
            __m512i weights[R];
            for (int i = 0; i < R; i++) {  // the weights ahead fetched while these compute (a batch's
                // decode step waited on memory without: four sequences 1.25x slower, alternating)
                prefetch_weights(block + i * group_bytes + step * kRowGroup + kPrefetchBytes);
                weights[i] = _mm512_loadu_si512(block + i * group_bytes + step * kRowGroup);
            }
            for (int t = 0; t < T; t++) {
                int32_t four;
                std::memcpy(&four, x + t * kBlock + step, sizeof four);
                const __m512i xs = _mm512_set1_epi32(four);
                for (int i = 0; i < R; i++) dot[i][t] = _mm512_dpbusd_epi32(dot[i][t], weights[i], xs);
            }
        }
        for (int t = 0; t < T; t++) {
            const __m512 scale = _mm512_set1_ps(q.scale[k * n + b0 + t]);
            for (int i = 0; i < R; i++)
                _mm512_store_ps(acc[i][t], _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i][t]), scale, _mm512_load_ps(acc[i][t])));
        }
    }
    for (int i = 0; i < R; i++) {  // times the rows' scales, for the rows below r1
        const int64_t row = (g + i) * kRowGroup, count = std::min<int64_t>(kRowGroup, r1 - row);
        const __mmask16 lanes = count >= kRowGroup ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1);
        const __m512 scales = _mm512_maskz_loadu_ps(lanes, scale + row);
        for (int t = 0; t < T; t++)
            _mm512_mask_storeu_ps(y + (b0 + t) * out + row, lanes, _mm512_mul_ps(_mm512_load_ps(acc[i][t]), scales));
    }
}

// Row groups g .. g + R against the tokens b0 <= b < b1, six at a time (tiles of 2 groups x 6 tokens: 3 x 4,
// 4 x 4, 3 x 6 and 4 x 3 measured within a few percent on an Intel Xeon)
constexpr int kPackedTokens = 6;

template <int R>
void packed_tokens_int8(const QuantizedBatch &q, int64_t b0, int64_t b1, const uint8_t *w, const float *scale,
                        int64_t in, int64_t out, int64_t g, int64_t r1, float *y) {
    for (; b0 + kPackedTokens <= b1; b0 += kPackedTokens)
        packed_block_int8<R, kPackedTokens>(q, b0, w, scale, in, out, g, r1, y);
    switch (b1 - b0) {
        case 1: packed_block_int8<R, 1>(q, b0, w, scale, in, out, g, r1, y); break;
        case 2: packed_block_int8<R, 2>(q, b0, w, scale, in, out, g, r1, y); break;
        case 3: packed_block_int8<R, 3>(q, b0, w, scale, in, out, g, r1, y); break;
        case 4: packed_block_int8<R, 4>(q, b0, w, scale, in, out, g, r1, y); break;
        case 5: packed_block_int8<R, 5>(q, b0, w, scale, in, out, g, r1, y); break;
        default: break;
    }
}

// Tokens per chunk of a prefill's matmul: while every row group of the range passes over them, their
// quantized x stays in cache (128 x 576 bytes: 72 KB)
constexpr int64_t kChunkTokens = 128;
constexpr int kTileGroups = 2;

// y[b][r0:r1] = (W[r0:r1, :] . x_b) * scale[r] for every token b, W packed (r0 a multiple of 16): a
// decode step's batch and a prefill's tokens alike
void packed_rows_int8(const QuantizedBatch &q, const uint8_t *w, const float *scale, int64_t in, int64_t out,
                      int64_t r0, int64_t r1, float *y) {
    const int64_t g0 = r0 / kRowGroup, g1 = (r1 + kRowGroup - 1) / kRowGroup;
    for (int64_t b0 = 0; b0 < q.n; b0 += kChunkTokens) {
        const int64_t b1 = std::min(q.n, b0 + kChunkTokens);
        int64_t g = g0;
        for (; g + kTileGroups <= g1; g += kTileGroups)
            packed_tokens_int8<kTileGroups>(q, b0, b1, w, scale, in, out, g, r1, y);
        for (; g < g1; g++) packed_tokens_int8<1>(q, b0, b1, w, scale, in, out, g, r1, y);
    }
}
#else
#if defined(__AVX2__) && defined(__FMA__)
// One block (64 inputs) of a weight row, ready for dot products with quantized blocks of x
struct BlockWeights {
    __m256i w0, w1;
#if defined(__AVXVNNI__)
    __m256i start;  // -128 * sum(w), once for the whole batch: (x + 128) . w plus this is x . w
#endif
    void load(const int8_t *block) {
        w0 = _mm256_loadu_si256((const __m256i *)block);
        w1 = _mm256_loadu_si256((const __m256i *)(block + 32));
#if defined(__AVXVNNI__)
        const __m256i bias = _mm256_set1_epi8(char(128));
        start = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_dpbusd_avx_epi32(
            _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), bias, w0), bias, w1));
#endif
    }
    // x . w in 8 lanes, for x's bytes and (without VNNI) signs
    __m256i dot(const uint8_t *x, [[maybe_unused]] const int8_t *signs) const {
        const __m256i x0 = _mm256_loadu_si256((const __m256i *)x), x1 = _mm256_loadu_si256((const __m256i *)(x + 32));
#if defined(__AVXVNNI__)
        return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(start, x0, w0), x1, w1);
#else
        const __m256i s0 = _mm256_sign_epi8(w0, _mm256_loadu_si256((const __m256i *)signs));
        const __m256i s1 = _mm256_sign_epi8(w1, _mm256_loadu_si256((const __m256i *)(signs + 32)));
        const __m256i ones = _mm256_set1_epi16(1);  // maddubs pairs are <= 2 * 127 * 127: no saturation
        return _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(x0, s0), ones),
                                _mm256_madd_epi16(_mm256_maddubs_epi16(x1, s1), ones));
#endif
    }
};

// the signs of block k of sequence b (null with VNNI, which keeps them in the bytes)
inline const int8_t *signs_of(const QuantizedBatch &q, int64_t k, int64_t b) {
    return kKeepsSign ? q.sign.data() + (k * q.n + b) * kBlock : nullptr;
}

inline float sum8(__m256 v) {
    __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    sum = _mm_hadd_ps(sum, sum);
    return _mm_cvtss_f32(_mm_hadd_ps(sum, sum));
}

// out[r][b] = sum over blocks of scale_b[block] * (x_b . row r)[block], for R rows of w and sequences
// b0 .. b0 + B: each block of weights and of x is loaded once for the R x B tile. Each sum is made in the
// same steps whatever R and B are (a decode step's R = 1), so a sequence's results do not depend on its
// neighbours in the batch, nor on whether a prefill or a decode step made them.
template <int R, int B>
void tile_dots_int8(const QuantizedBatch &q, int64_t b0, const int8_t *w, int64_t in, float out[R][kMaxBatch]) {
    const int64_t blocks = in / kBlock, n = q.n;
    __m256 acc[R][B];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++) acc[r][b] = _mm256_setzero_ps();
    for (int64_t k = 0; k < blocks; k++) {
        BlockWeights weights[R];
        for (int r = 0; r < R; r++) {
            prefetch_weights(w + r * in + kPrefetchBytes + k * kBlock);
            weights[r].load(w + r * in + k * kBlock);
        }
        const uint8_t *x = q.bytes.data() + (k * n + b0) * kBlock;
        const float *scale = q.scale.data() + k * n + b0;
        for (int b = 0; b < B; b++) {
            const int8_t *signs = signs_of(q, k, b0 + b);
            for (int r = 0; r < R; r++)
                acc[r][b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(weights[r].dot(x + b * kBlock, signs)),
                                            _mm256_set1_ps(scale[b]), acc[r][b]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++) out[r][b] = sum8(acc[r][b]);
}

constexpr int kTileRows = 3;  // a prefill's weight rows per tile (3 x 4 tokens measured faster than 1, 2, 4 rows)
#else
// out[b] = sum over blocks of scale_b[block] * (x_b . row)[block], for sequences b0 .. b0 + B
template <int B>
void row_dots_int8(const QuantizedBatch &q, int64_t b0, const int8_t *row, int64_t in, float *out) {
    const int64_t blocks = in / kBlock, n = q.n;
    for (int b = 0; b < B; b++) {
        float total = 0.0f;
        for (int64_t k = 0; k < blocks; k++) {
            const uint8_t *x = q.bytes.data() + (k * n + b0 + b) * kBlock;
            const int8_t *signs = q.sign.data() + (k * n + b0 + b) * kBlock;
            int32_t dot = 0;
            for (int64_t i = 0; i < kBlock; i++) dot += int32_t(x[i]) * signs[i] * row[k * kBlock + i];
            total += q.scale[k * n + b0 + b] * float(dot);
        }
        out[b] = total;
    }
}
#endif  // AVX2
#endif  // packed rows (AVX-512)

#if !defined(PS_PACKED_ROWS)
#if !(defined(__AVX2__) && defined(__FMA__))
// R rows one after the other: the scalar path has no registers to share
template <int R, int B>
void tile_dots_int8(const QuantizedBatch &q, int64_t b0, const int8_t *w, int64_t in, float out[R][kMaxBatch]) {
    for (int r = 0; r < R; r++) row_dots_int8<B>(q, b0, w + r * in, in, out[r]);
}
constexpr int kTileRows = 1;
#endif

// y[b][r .. r + R) for the sequences b0 <= b < b1, up to four at a time: the rows' dot products, times
// their scales
template <int R>
void tile_range_int8(const QuantizedBatch &q, int64_t b0, int64_t b1, const int8_t *w, const float *scale,
                     int64_t in, int64_t out, int64_t r, float *y) {
    float dots[R][kMaxBatch];
    for (; b0 < b1; b0 += kMaxBatch) {
        const int64_t count = std::min(kMaxBatch, b1 - b0);
        switch (count) {
            case 1: tile_dots_int8<R, 1>(q, b0, w + r * in, in, dots); break;
            case 2: tile_dots_int8<R, 2>(q, b0, w + r * in, in, dots); break;
            case 3: tile_dots_int8<R, 3>(q, b0, w + r * in, in, dots); break;
            default: tile_dots_int8<R, 4>(q, b0, w + r * in, in, dots); break;
        }
        for (int i = 0; i < R; i++)
            for (int64_t b = 0; b < count; b++) y[(b0 + b) * out + r + i] = dots[i][b] * scale[r + i];
    }
}

// y[b][r0:r1] for the sequences b0 <= b < b1: kTileRows rows at a time, then the rows left one by one
void rows_int8(const QuantizedBatch &q, int64_t b0, int64_t b1, const int8_t *w, const float *scale, int64_t in,
               int64_t out, int64_t r0, int64_t r1, float *y) {
    int64_t r = r0;
    for (; r + kTileRows <= r1; r += kTileRows) tile_range_int8<kTileRows>(q, b0, b1, w, scale, in, out, r, y);
    for (; r < r1; r++) tile_range_int8<1>(q, b0, b1, w, scale, in, out, r, y);
}

// y[b][r0:r1] = (W[r0:r1, :] . x_b) * scale[r] with W int8 output-major [out][in], one scale per row.
// Each row is read once and used for every sequence while it is in L1.
void matvec_int8_rows(const QuantizedBatch &q, const int8_t *w, const float *scale, int64_t in, int64_t out,
                      int64_t r0, int64_t r1, float *y) {
    for (int64_t r = r0; r < r1; r++) tile_range_int8<1>(q, 0, q.n, w, scale, in, out, r, y);
}

// The same products for a prefill's many rows of x: with AVX2 matvec's tiles of rows x 4 tokens, the
// tokens a chunk at a time so that their quantized x stays in cache while every row of the range passes
// over it (row by row over all of x, x streamed from memory once per row). Each (row, token) sum is made
// exactly as a decode step makes it: a prefill gives its numbers.
void matmul_int8_rows(const QuantizedBatch &q, const int8_t *w, const float *scale, int64_t in, int64_t out,
                      int64_t r0, int64_t r1, float *y) {
#if defined(__AVX2__) && defined(__FMA__)
    constexpr int64_t kChunk = 64;
    for (int64_t t0 = 0; t0 < q.n; t0 += kChunk)
        rows_int8(q, t0, std::min(q.n, t0 + kChunk), w, scale, in, out, r0, r1, y);
#else
    matvec_int8_rows(q, w, scale, in, out, r0, r1, y);
#endif
}
#endif  // rows as they are

// y[b][r0:r1] for every sequence b of q: a decode step's batch or (tiled) a prefill's tokens
void int8_rows(const QuantizedBatch &q, const void *w, const float *scale, int64_t in, int64_t out, int64_t r0,
               int64_t r1, bool tiled, float *y) {
#if defined(PS_PACKED_ROWS)
    (void)tiled;  // one kernel for both
    packed_rows_int8(q, static_cast<const uint8_t *>(w), scale, in, out, r0, r1, y);
#else
    if (tiled)
        matmul_int8_rows(q, static_cast<const int8_t *>(w), scale, in, out, r0, r1, y);
    else
        matvec_int8_rows(q, static_cast<const int8_t *>(w), scale, in, out, r0, r1, y);
#endif
}

// y[b] = x[b] W^T (* scale) (+ bias) for every sequence b < n; x [n][in], y [n][out]. Each thread streams
// one contiguous range of output rows, once for the whole batch. tiled: a prefill's many rows of x, int8
// through matmul_int8_rows (the same sums, made tile by tile).
void linear(const Dims &d, const Linear &lin, const float *x, int64_t n, int64_t in, int64_t out, float *y,
            bool tiled = false) {
    QuantizedBatch q(d.is_int8 ? n : 0, in);
#pragma omp parallel num_threads(d.threads)
    {
        if (d.is_int8) {  // threads take ranges of blocks: each writes its own stretch of the layout
#pragma omp for schedule(static)
            for (int64_t k = 0; k < in / kBlock; k++)
                for (int64_t b = 0; b < n; b++) q.quantize(k, b, x + b * in + k * kBlock);
        }
        const int64_t team = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t per = ((out + team - 1) / team + 15) / 16 * 16;
        const int64_t c0 = std::min(out, t * per), c1 = std::min(out, c0 + per);
        if (c0 < c1) {
            if (d.is_int8)
                int8_rows(q, lin.weight, lin.scale, in, out, c0, c1, tiled, y);
            else
                matvec_f32_rows(x, n, static_cast<const float *>(lin.weight), in, out, c0, c1, y);
            if (lin.bias)
                for (int64_t b = 0; b < n; b++)
                    for (int64_t c = c0; c < c1; c++) y[b * out + c] += lin.bias[c];
        }
    }
}

// RMSNorm of one row. Its sum of squares runs in 4 x 8 lanes, then across them: a fixed order for a given n,
// whatever the batch. (A chain of scalar double adds took 0.8 us a row: a decode step of four sequences
// spent 0.19 ms of its 4.4 in its 61 norms.)
void rms_norm(const float *x, const float *weight, int64_t n, float eps, float *y) {
    Vec lanes[4] = {};
    int64_t i = 0;
    for (; i + 32 <= n; i += 32)
        for (int j = 0; j < 4; j++) {
            const Vec v = load8(x + i + 8 * j);
            lanes[j] += v * v;
        }
    float sum = sum_lanes((lanes[0] + lanes[1]) + (lanes[2] + lanes[3]));
    for (; i < n; i++) sum += x[i] * x[i];
    const float inv = 1.0f / std::sqrt(sum / float(n) + eps);
    for (i = 0; i < n; i++) y[i] = x[i] * inv * weight[i];
}

// q and k heads rotated in place: pairs (a, b) times (cos + i sin) of this position.
void rotary(float *heads, int64_t num_heads, int64_t head_dim, const float *cos, const float *sin) {
    const int64_t half = head_dim / 2;
    for (int64_t h = 0; h < num_heads; h++) {
        float *x = heads + h * head_dim;
        for (int64_t i = 0; i < half; i++) {
            const float a = x[2 * i], b = x[2 * i + 1];
            x[2 * i] = a * cos[i] - b * sin[i];
            x[2 * i + 1] = a * sin[i] + b * cos[i];
        }
    }
}

// Rows of the KV cache a decode step's attention fetches ahead of the one it computes on.
constexpr int64_t kAheadRows = 8;  // (4: 5 % slower at four sequences; 12 and 16 no faster)

template <typename KV, int64_t S>
inline void prefetch_row(const KV *row) {
    for (int64_t byte = 0; byte < S * int64_t(sizeof(KV)); byte += 64)
        __builtin_prefetch(reinterpret_cast<const char *>(row) + byte);
}

// In a walk over positions [.., t1) block by block, the row kAheadRows ahead of row t, in this block (rows
// at block + t * S, up to end) or the next (next + t * S): a sequence's blocks lie anywhere in the pool,
// and the hardware prefetcher, starting afresh on each 4 KB block, left the loads waiting on memory.
template <typename KV, int64_t S>
inline void prefetch_ahead(const KV *block, const KV *next, int64_t t, int64_t end, int64_t t1, int64_t bs) {
    const int64_t ahead = t + kAheadRows;
    if (ahead < t1 && ahead < end + bs) prefetch_row<KV, S>(ahead < end ? block + ahead * S : next + ahead * S);
}

#if defined(__AVX512F__)
// attend_group_part's values: out_g = sum over positions t of p_g[t] v_t for the G heads of a KV group,
// p: their exponentials [G][t1 - t0]. Each value row is read and converted once for all G heads, C
// columns at a time, with the heads' outputs in G x C / 16 registers; each output is the same sum, in
// the same order, as one head at a time makes it.
template <int D, int G, typename KV>
void add_values(const float *p, const KV *v, const int64_t *table, int64_t bs, int64_t t0, int64_t t1,
                float *out) {
    constexpr int64_t S = row_size<KV>(D);
    constexpr int C = G <= 4 || D < 64 ? std::min(D, 64) : 32, W = C / 16;
    const int64_t n = t1 - t0;
    for (int c0 = 0; c0 < D; c0 += C) {
        Vec16 acc[G][W] = {};
        for (int64_t start = t0; start < t1;) {
            const int64_t end = std::min(t1, (start / bs + 1) * bs);
            const KV *vb = v + (table[start / bs] * bs - (start / bs) * bs) * S;
            const KV *next = end < t1 ? v + (table[end / bs] * bs - end) * S : vb;  // the next block's, alike
            for (int64_t t = start; t < end; t++) {
                // the next block's first rows: within a block the hardware prefetcher keeps ahead. (Fetching
                // every value row ahead, here and in the key pass, made TPOT at 4,096 tokens ~5 % slower.)
                if (c0 == 0 && t + kAheadRows >= end) prefetch_ahead<KV, S>(vb, next, t, end, t1, bs);
                const RowReader<KV> value(vb + t * S, D);
                Vec16 x[W];
                for (int w = 0; w < W; w++) x[w] = value.load16(c0 + 16 * w);
                for (int g = 0; g < G; g++) {
                    const float weight = p[g * n + t - t0] * value.scale;
                    for (int w = 0; w < W; w++) acc[g][w] += weight * x[w];
                }
            }
            start = end;
        }
        for (int g = 0; g < G; g++)
            for (int w = 0; w < W; w++) *reinterpret_cast<Vec16 *>(out + g * D + c0 + 16 * w) = acc[g][w];
    }
}
#endif

#if defined(__AVX512F__)
// key_scores for an fp16 or int8 cache, whose rows are converted before the arithmetic and which make the
// arithmetic the bound: 16 positions at a time, converted once for all the heads, their 16 dot products
// per head side by side (independent chains, 16 lanes wide), then summed all at once by sums_of_16 (row
// by row, a chain of dependent adds per head and position). An fp32 cache is bound by memory and read
// faster row by row (tiles measured 5-10 % slower there).
template <int D, typename KV>
void key_scores_tiled(const float *q, int64_t group, const KV *k, const KV *v, const int64_t *table, int64_t bs,
                      int64_t t0, int64_t t1, float scale, float *s, float *most) {
    constexpr int64_t S = row_size<KV>(D);
    const int64_t n = t1 - t0;
    constexpr int W = D / 16;
    const auto slot = [&](int64_t t) { return (table[t / bs] * bs + t % bs) * S; };
    for (int64_t start = t0; start < t1; start += 16) {
        const int64_t count = std::min<int64_t>(16, t1 - start);
        const KV *rows[16];
        alignas(64) float scales[16], tile[16];
        for (int64_t i = 0; i < 16; i++) {
            const int64_t t = start + std::min(i, count - 1);  // past the end: the last row again, unused
            rows[i] = k + slot(t);
            scales[i] = RowReader<KV>(rows[i], D).scale * scale;
            if (i < count) {  // the key a tile ahead and this position's value, which the value pass reads next
                if (t + 16 < t1) prefetch_row<KV, S>(k + slot(t + 16));
                prefetch_row<KV, S>(v + slot(t));
            }
        }
        Vec16 keys[16][W];  // as fp32, converted once for all the heads
        for (int i = 0; i < 16; i++)
            for (int w = 0; w < W; w++) keys[i][w] = RowReader<KV>(rows[i], D).load16(16 * w);
        for (int64_t g = 0; g < group; g++) {
            const Vec16 *qg = reinterpret_cast<const Vec16 *>(q + g * D);
            Vec16 dot[16];
            for (int i = 0; i < 16; i++) dot[i] = qg[0] * keys[i][0];
            for (int w = 1; w < W; w++)
                for (int i = 0; i < 16; i++) dot[i] += qg[w] * keys[i][w];
            const Vec16 scores = sums_of_16(dot) * *reinterpret_cast<const Vec16 *>(scales);
            *reinterpret_cast<Vec16 *>(tile) = scores;
            std::copy(tile, tile + count, s + g * n + start - t0);
            most[g] = std::max(most[g], _mm512_mask_reduce_max_ps(__mmask16((1u << count) - 1), (__m512)scores));
        }
    }
}
#endif

// attend_group_part's scores: s[g][t - t0] = q_g . k_t * scale for every head g of the group and position t
// in [t0, t1), and each head's maximum, most[g].
template <int D, typename KV>
void key_scores(const float *q, int64_t group, const KV *k, const KV *v, const int64_t *table, int64_t bs,
                int64_t t0, int64_t t1, float scale, float *s, float *most) {
    constexpr int64_t S = row_size<KV>(D);
    const int64_t n = t1 - t0;
    for (int64_t g = 0; g < group; g++) most[g] = -INFINITY;
#if defined(__AVX512F__)
    if constexpr (!std::is_same<KV, float>::value)
        return key_scores_tiled<D, KV>(q, group, k, v, table, bs, t0, t1, scale, s, most);
#endif
    constexpr int V = D / kVec;
    for (int64_t start = t0; start < t1;) {  // block by block: no division per position
        const int64_t end = std::min(t1, (start / bs + 1) * bs);
        const int64_t shift = (table[start / bs] - start / bs) * bs * S;  // kb + t * S: position t's key row
        const KV *kb = k + shift;
        const KV *next = end < t1 ? k + (table[end / bs] * bs - end) * S : kb;  // the next block's, alike
        for (int64_t t = start; t < end; t++) {
            prefetch_ahead<KV, S>(kb, next, t, end, t1, bs);  // the key kAheadRows ahead
#if !defined(__AVX512F__)  // and this position's value, which the value pass reads next (add_values: its own)
            prefetch_row<KV, S>(v + shift + t * S);
#endif
            const RowReader<KV> key(kb + t * S, D);
            Vec kt[V];
            for (int j = 0; j < V; j++) kt[j] = key.load8(j * kVec);
            for (int64_t g = 0; g < group; g++) {
                const Vec *qg = reinterpret_cast<const Vec *>(q + g * D);
                Vec dot = qg[0] * kt[0];
                for (int j = 1; j < V; j++) dot += qg[j] * kt[j];
                s[g * n + t - t0] = sum_halves(dot) * key.scale * scale;
                most[g] = std::max(most[g], s[g * n + t - t0]);
            }
        }
        start = end;
    }
}

// The query heads of one KV group of one sequence (GQA: they share keys and values) over positions
// [t0, t1) of the sequence's blocks: for each head g, its scores' maximum m[g], the sum l[g] of
// exp(score - m[g]), and out_g = sum of exp(score - m[g]) v, not yet divided by l[g]. s: scratch
// [group][t1 - t0]. Each key and value is fetched from the cache once for the whole group. D (the head
// dimension) known at compile time keeps q and the output in registers.
template <int D, typename KV>
void attend_group_part(const float *q, int64_t group, const KV *k, const KV *v, const int64_t *table,
                       int64_t bs, int64_t t0, int64_t t1, float scale, float *s, float *out, float *m, float *l) {
    const int64_t n = t1 - t0;
    // each head's maximum so far, kept here, not in m: in a split step another thread's m may share its
    // cache line, and writing it for every position made the split slower than no split (measured)
    float most[8];
    key_scores<D, KV>(q, group, k, v, table, bs, t0, t1, scale, s, most);
    for (int64_t g = 0; g < group; g++) {
        float *sg = s + g * n, total = 0.0f;
        const float top = m[g] = most[g];
#pragma omp simd reduction(+ : total)
        for (int64_t t = 0; t < n; t++) total += (sg[t] = fast_exp(sg[t] - top));
        l[g] = total;
    }
#if defined(__AVX512F__)
    switch (group) {  // the heads' count known at compile time keeps their outputs in registers
        case 1: return add_values<D, 1, KV>(s, v, table, bs, t0, t1, out);
        case 2: return add_values<D, 2, KV>(s, v, table, bs, t0, t1, out);
        case 3: return add_values<D, 3, KV>(s, v, table, bs, t0, t1, out);
        case 4: return add_values<D, 4, KV>(s, v, table, bs, t0, t1, out);
        case 5: return add_values<D, 5, KV>(s, v, table, bs, t0, t1, out);
        case 6: return add_values<D, 6, KV>(s, v, table, bs, t0, t1, out);
        case 7: return add_values<D, 7, KV>(s, v, table, bs, t0, t1, out);
        default: return add_values<D, 8, KV>(s, v, table, bs, t0, t1, out);
    }
#else
    constexpr int V = D / kVec;
    constexpr int64_t S = row_size<KV>(D);
    for (int64_t g = 0; g < group; g++) {  // head by head: values from memory for the first, then L1
        const float *sg = s + g * n;
        Vec acc[V] = {};
        for (int64_t start = t0; start < t1;) {
            const int64_t end = std::min(t1, (start / bs + 1) * bs);
            const KV *vb = v + (table[start / bs] * bs - (start / bs) * bs) * S;
            for (int64_t t = start; t < end; t++) {
                const RowReader<KV> value(vb + t * S, D);
                const float weight = sg[t - t0] * value.scale;
                for (int j = 0; j < V; j++) acc[j] += weight * value.load8(j * kVec);
            }
            start = end;
        }
        for (int j = 0; j < V; j++) *reinterpret_cast<Vec *>(out + g * D + j * kVec) = acc[j];
    }
#endif
}

// attend_group_part over all n positions, normalized: out_g = softmax(q_g . K^T * scale) V.
template <int D, typename KV>
void attend_group(const float *q, int64_t group, const KV *k, const KV *v, const int64_t *table, int64_t bs,
                  int64_t n, float scale, float *s, float *out) {
    float m[8], l[8];
    attend_group_part<D, KV>(q, group, k, v, table, bs, 0, n, scale, s, out, m, l);
    for (int64_t g = 0; g < group; g++) {
        const Vec inverse = Vec{} + 1.0f / l[g];
        for (int j = 0; j < D / kVec; j++) *reinterpret_cast<Vec *>(out + g * D + j * kVec) *= inverse;
    }
}

// The same for any head dimension, the output accumulated in memory.
template <typename KV>
void attend_head_any(const float *q, const KV *k, const KV *v, const int64_t *table, int64_t bs, int64_t n,
                     int64_t D, float scale, float *s, float *out) {
    float top = -INFINITY;
    for (int64_t t = 0; t < n; t++) {
        const RowReader<KV> key(k + (table[t / bs] * bs + t % bs) * row_size<KV>(D), D);
        float dot = 0.0f;
        for (int64_t i = 0; i < D; i++) dot += q[i] * key.load1(i);
        s[t] = dot * key.scale * scale;
        top = std::max(top, s[t]);
    }
    float total = 0.0f;
    for (int64_t t = 0; t < n; t++) total += (s[t] = fast_exp(s[t] - top));
    std::fill(out, out + D, 0.0f);
    for (int64_t t = 0; t < n; t++) {
        const RowReader<KV> value(v + (table[t / bs] * bs + t % bs) * row_size<KV>(D), D);
        const float weight = s[t] * value.scale;
        for (int64_t i = 0; i < D; i++) out[i] += weight * value.load1(i);
    }
    for (int64_t i = 0; i < D; i++) out[i] /= total;
}

// attention() for every sequence, each (sequence, group) cut into chunks of `length` positions: one task
// per chunk, then per head out = sum_c out_c e^(m_c - M) / sum_c l_c e^(m_c - M), M = max_c m_c; and, for
// sequence capture_b (if any), its attention weights, each chunk's e^(score - m_c) times e^(m_c - M) / L.
template <typename KV>
void split_attention(const Dims &d, const Batch &batch, const float *q, int64_t q_stride, const KV *keys,
                     const KV *values, float *out, int64_t length, float *capture, int64_t capture_b) {
    const int64_t D = d.head_dim, group = d.heads / d.kv_heads, bs = d.block_size;
    const float scale = 1.0f / std::sqrt(float(D));
    std::vector<int64_t> first(batch.size + 1, 0);  // each sequence's first chunk
    for (int64_t b = 0; b < batch.size; b++) first[b + 1] = first[b] + (batch.positions[b] + length) / length;
    const int64_t chunks = first[batch.size], tasks = chunks * d.kv_heads;
    std::vector<float> parts(tasks * group * D), maxima(tasks * group), sums(tasks * group);
    std::unique_ptr<float[]> scores(new float[tasks * group * length]);  // each task's e^(score - m_c), [group][chunk]
#pragma omp parallel for num_threads(d.threads) schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; task++) {  // (chunk, KV group)
        const int64_t c = task / d.kv_heads, g = task % d.kv_heads;
        const int64_t b = std::upper_bound(first.begin(), first.end(), c) - first.begin() - 1;
        const int64_t t0 = (c - first[b]) * length, t1 = std::min(batch.positions[b] + 1, t0 + length);
        const float *qg = q + b * q_stride + g * group * D;
        const KV *k = keys + g * d.num_slots * row_size<KV>(D), *v = values + g * d.num_slots * row_size<KV>(D);
        const int64_t *table = batch.tables + b * batch.table_stride;
        float *s = scores.get() + task * group * length, *o = parts.data() + task * group * D;
        float *m = &maxima[task * group], *l = &sums[task * group];
        if (D == 64)
            attend_group_part<64, KV>(qg, group, k, v, table, bs, t0, t1, scale, s, o, m, l);
        else
            attend_group_part<128, KV>(qg, group, k, v, table, bs, t0, t1, scale, s, o, m, l);
    }
    for (int64_t b = 0; b < batch.size; b++) {  // merge each head's chunks
        const int64_t n = batch.positions[b] + 1;
        for (int64_t g = 0; g < d.kv_heads; g++)
            for (int64_t h = 0; h < group; h++) {
                float most = -INFINITY, total = 0.0f;
                for (int64_t c = first[b]; c < first[b + 1]; c++)
                    most = std::max(most, maxima[(c * d.kv_heads + g) * group + h]);
                float *o = out + (b * d.heads + g * group + h) * D;
                std::fill(o, o + D, 0.0f);
                for (int64_t c = first[b]; c < first[b + 1]; c++) {
                    const int64_t at = (c * d.kv_heads + g) * group + h;
                    const float weight = std::exp(maxima[at] - most);
                    total += sums[at] * weight;
                    for (int64_t i = 0; i < D; i++) o[i] += parts[at * D + i] * weight;
                }
                const float inverse = 1.0f / total;  // as attend_group: one chunk gives its result exactly
                for (int64_t i = 0; i < D; i++) o[i] *= inverse;
                if (b != capture_b) continue;
                for (int64_t c = first[b]; c < first[b + 1]; c++) {  // this head's weights, chunk by chunk
                    const int64_t task = c * d.kv_heads + g, t0 = (c - first[b]) * length;
                    const int64_t t1 = std::min(n, t0 + length);
                    const float *e = scores.get() + task * group * length + h * (t1 - t0);
                    const float weight = std::exp(maxima[task * group + h] - most) * inverse;
                    for (int64_t t = t0; t < t1; t++) capture[(g * group + h) * n + t] = e[t - t0] * weight;
                }
            }
    }
}

// Flash Decoding: at long context one (sequence, KV group) is too coarse a task (B = 1 with 3 KV heads on
// 2 threads leaves one thread two groups), so each sequence's positions are cut into chunks of
// kSplitLength, one task each, whose partial outputs are merged exactly (the log-sum-exp rule). The cut
// depends on the sequence alone, never on the batch: a sequence's output stays the same whoever else
// runs beside it (and a sequence of one chunk gets exactly the unsplit result).
constexpr int64_t kSplitLength = 512;

bool splits(const Dims &d, const Batch &batch) {
    if (!d.split_kv || (d.head_dim != 64 && d.head_dim != 128) || d.heads / d.kv_heads > 8) return false;
    for (int64_t b = 0; b < batch.size; b++)
        if (batch.positions[b] + 1 > kSplitLength) return true;
    return false;
}

// out[b][h] = softmax(q_bh . K^T / sqrt(D)) V over positions [0, pos_b] of sequence b's blocks, for every
// sequence and head: one task per (sequence, KV group), or per chunk of one (splits), each reading its
// own cache length.
template <typename KV>
void attention(const Dims &d, const Batch &batch, const float *q, int64_t q_stride, const KV *keys,
               const KV *values, float *out, float *capture, int64_t capture_b) {
    const int64_t D = d.head_dim, group = d.heads / d.kv_heads, bs = d.block_size;
    const float scale = 1.0f / std::sqrt(float(D));
    if (splits(d, batch)) {
        split_attention(d, batch, q, q_stride, keys, values, out, kSplitLength, capture, capture_b);
        return;
    }
    std::vector<int64_t> offset(batch.size + 1, 0);  // each (sequence, head)'s scores in one buffer
    for (int64_t b = 0; b < batch.size; b++) offset[b + 1] = offset[b] + d.heads * (batch.positions[b] + 1);
    std::unique_ptr<float[]> scores(new float[offset[batch.size]]);  // written before read: no zeroing
#pragma omp parallel for num_threads(d.threads) schedule(dynamic, 1)
    for (int64_t task = 0; task < batch.size * d.kv_heads; task++) {  // one task per (sequence, KV group)
        const int64_t b = task / d.kv_heads, g = task % d.kv_heads, n = batch.positions[b] + 1;
        const float *qg = q + b * q_stride + g * group * D;
        const KV *k = keys + g * d.num_slots * row_size<KV>(D), *v = values + g * d.num_slots * row_size<KV>(D);
        const int64_t *table = batch.tables + b * batch.table_stride;
        float *s = scores.get() + offset[b] + g * group * n, *o = out + (b * d.heads + g * group) * D;
        if (D == 64 && group <= 8) {
            attend_group<64>(qg, group, k, v, table, bs, n, scale, s, o);
        } else if (D == 128 && group <= 8) {
            attend_group<128>(qg, group, k, v, table, bs, n, scale, s, o);
        } else {
            for (int64_t h = 0; h < group; h++)
                attend_head_any(qg + h * D, k, v, table, bs, n, D, scale, s + h * n, o + h * D);
        }
        if (capture != nullptr && b == capture_b) {  // this sequence's attention weights, [heads][n]
            for (int64_t h = 0; h < group; h++) {
                const float *weights = s + h * n;  // exp(score - max), not yet normalized
                float total = 0.0f;
                for (int64_t t = 0; t < n; t++) total += weights[t];
                for (int64_t t = 0; t < n; t++) capture[(g * group + h) * n + t] = weights[t] / total;
            }
        }
    }
}

// --- prefill attention -------------------------------------------------------------------------------
// The T tokens of one prefill chunk (positions [pos, pos + T) of a sequence) attend causally over the
// sequence's keys and values, read in place through its block table: no copy of the cached prefix into
// one tensor, which a scattered table (a shared system prompt, then this chat's blocks) would need in
// PyTorch. Per KV group, the group's query heads times a tile of tokens are the rows of two small matrix
// products, taken kBlockKeys keys at a time as FlashAttention does: scores = Q K^T, kKeyTile keys at a
// time transposed to [D][kKeyTile] so that a row's scores are lanes of two vectors (no horizontal sums);
// an online softmax (each row's running maximum and sum; its outputs so far rescaled when the maximum
// grows); out += P V, each value row loaded once for several rows. The scores never exceed one block, so
// they stay in L2 however long the context (a whole row of scores per row, 1.2 MB a tile at 6,144 keys,
// went to L3 and back four times: prefill attention 1.03-1.1x slower at depth 4,096). The blocks start
// at key 0, and every row's sums run over exactly its own keys in one fixed order, so a token's output
// does not depend on how the prompt was cut into chunks: prefix caching stays exact.
// The tiles are sized to the vector registers, 32 of 16 floats with AVX-512, 16 of 8 floats with AVX2:
// too many accumulators spill to the stack on every multiply-add (a 64-byte vector is two AVX2 registers,
// which the compiler kept in memory: 3x slower prefill attention than these 8-float vectors).
#if defined(__AVX512F__)
typedef Vec16 Lanes;                  // the vectors of the score and value stages
constexpr int64_t kKeyTile = 32;      // keys per score tile: two vectors per row
constexpr int64_t kValueColumns = 0;  // output columns accumulated at once: 0 = the whole head (D)
constexpr int64_t kValueRows = 6;     // rows whose outputs are accumulated together (24 registers; 4 rows
                                      // measured 5-9 % slower over 1,024-4,096 cached keys, the same sums)
#else
typedef Vec Lanes;
constexpr int64_t kKeyTile = 16;
constexpr int64_t kValueColumns = 16;
constexpr int64_t kValueRows = 6;
#endif
constexpr int64_t kLanes = sizeof(Lanes) / sizeof(float);
constexpr int kKeyVecs = kKeyTile / kLanes;
constexpr int64_t kScoreRows = 6;    // query rows whose scores are computed together (12 registers)
constexpr int64_t kTileTokens = 16;  // tokens per task
constexpr int64_t kBlockKeys = 256;  // keys per block of the online softmax (128 and 512 were no faster)

// Scratch memory of this thread, kept between calls (a fresh allocation per call was a page fault per
// 4 KB, as long as the arithmetic itself); which: one of a few buffers in use at once.
float *scratch(int which, int64_t size) {
    thread_local std::vector<float> buffers[5];
    if (int64_t(buffers[which].size()) < size) buffers[which].resize(size);
    return buffers[which].data();
}

#if defined(__AVX512F__)
// Two 8-float halves as one register. (Joined through memory, two 32-byte stores then a 64-byte load,
// every value load of prefill attention waited on a failed store forwarding: 2x slower there.)
inline Vec16 join16(Vec low, Vec high) {
    const __m512d both = _mm512_insertf64x4(_mm512_castpd256_pd512((__m256d)low), (__m256d)high, 1);
    return (Vec16)both;
}
#endif

template <typename KV>
inline Lanes load_lanes(const RowReader<KV> &row, int64_t i) {
#if defined(__AVX512F__)
    return join16(row.load8(i), row.load8(i + 8));
#else
    return row.load8(i);
#endif
}

// The maximum and the sum of s[0, n), in 16 lanes (two vectors with AVX2, one with AVX-512) and then across
// them: a fixed order for a given n, and no chain of scalar additions. (A 64-byte vector type with AVX2 was
// taken apart lane by lane: prefill attention 1.2-1.4x slower, the same sums.)
inline float max_of(const float *s, int64_t n) {
    constexpr int V = 16 / kLanes;
    Lanes top[V];
    for (int j = 0; j < V; j++) top[j] = s[0] - Lanes{};  // s[0] in every lane; a maximum is the same in any order
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < V; j++) {
            const Lanes x = *reinterpret_cast<const Lanes *>(s + i + j * kLanes);
            top[j] = x > top[j] ? x : top[j];
        }
    float most = s[0];
    for (int j = 0; j < V; j++)
        for (int64_t k = 0; k < kLanes; k++) most = std::max(most, top[j][k]);
    for (; i < n; i++) most = std::max(most, s[i]);
    return most;
}

inline float sum_of(const float *s, int64_t n) {
    constexpr int V = 16 / kLanes;
    Lanes lanes[V] = {};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < V; j++) lanes[j] += *reinterpret_cast<const Lanes *>(s + i + j * kLanes);
    float total = 0.0f;
    for (int j = 0; j < V; j++)
        for (int64_t k = 0; k < kLanes; k++) total += lanes[j][k];
    for (; i < n; i++) total += s[i];
    return total;
}

// Rows [0, rows) of one (KV group, token tile): row r is token t0 + r / group, query head r % group of the
// group, at position pos + t0 + r / group. q points at the group's first head of token 0; out likewise.
// Keys [0, n) of one KV group, kKeyTile at a time transposed: kt [n / kKeyTile rounded up][D][kKeyTile],
// zero past n.
template <typename KV>
void transpose_keys(const KV *k, const int64_t *table, int64_t bs, int64_t D, int64_t n, int64_t tile,
                    float *kt) {
    float *out = kt + tile * D * kKeyTile;
    static const KV zeros[256 + 4] = {};  // the keys past n (D <= 256): 0 in every format
    const KV *key[kKeyTile];
    for (int64_t j = 0; j < kKeyTile; j++) {
        const int64_t p = tile * kKeyTile + j;
        key[j] = p < n ? k + (table[p / bs] * bs + p % bs) * row_size<KV>(D) : zeros;
    }
    for (int64_t d = 0; d < D; d++)  // stores in order; the 32 key rows stay in L1
        for (int64_t j = 0; j < kKeyTile; j++) {
            const RowReader<KV> row(key[j], D);
            out[d * kKeyTile + j] = row.load1(d) * row.scale;
        }
}

// kt: the group's keys from transpose_keys; v: its values in the pool.
template <int D, typename KV>
void attend_prefill_tile(const float *q, int64_t q_stride, int64_t group, const float *kt, const KV *v,
                         const int64_t *table, int64_t bs, int64_t pos, int64_t t0, int64_t t1, float scale,
                         float *out, int64_t out_stride) {
    const int64_t rows = (t1 - t0) * group, n = pos + t1;  // the tile's last token sees n keys
    // row r's place in a [tokens][heads * D] layout: its token's row, then its head
    auto row_in = [&](auto *rows_of, int64_t stride, int64_t r) {
        return rows_of + (t0 + r / group) * stride + (r % group) * D;
    };
    auto q_row = [&](int64_t r) { return row_in(q, q_stride, r); };
    auto out_row = [&](int64_t r) { return row_in(out, out_stride, r); };
    auto limit = [&](int64_t r) { return pos + t0 + r / group + 1; };  // keys [0, limit) are visible
    // the rows' queries kScoreRows at a time as [D][kScoreRows], so that a d's multipliers lie together
    // (read from six rows of q, the score stage took 3-5 % longer)
    const int64_t groups = (rows + kScoreRows - 1) / kScoreRows;
    float *packed = scratch(4, groups * D * kScoreRows);
    for (int64_t r = 0; r < groups * kScoreRows; r++) {  // past the last row: the last row again
        const float *row = q_row(std::min(r, rows - 1));
        float *to = packed + (r / kScoreRows) * D * kScoreRows + r % kScoreRows;
        for (int d = 0; d < D; d++) to[d * kScoreRows] = row[d];
    }
    constexpr int64_t B = kBlockKeys;
    float *scores = scratch(0, rows * B), *most = scratch(1, 2 * rows), *total = most + rows;
    float *zeros = scratch(3, B);
    std::fill(zeros, zeros + B, 0.0f);
    for (int64_t r = 0; r < rows; r++) std::fill(out_row(r), out_row(r) + D, 0.0f);
    constexpr int C = (kValueColumns == 0 ? D : kValueColumns) / kLanes;  // accumulators per row
    for (int64_t k0 = 0; k0 < n; k0 += B) {
        const int64_t k1 = std::min(n, k0 + B);
        // scores of keys [k0, k1)
        for (int64_t start = k0; start < k1; start += kKeyTile) {
            const float *keys = kt + start * D;  // keys [start, start + kKeyTile) as [D][kKeyTile]
            for (int64_t r0 = 0; r0 < rows; r0 += kScoreRows) {
                if (limit(std::min(rows, r0 + kScoreRows) - 1) <= start) continue;  // all these keys are in the future
                const float *queries = packed + r0 * D;  // [D][kScoreRows]
                Lanes acc[kScoreRows][kKeyVecs] = {};
                for (int d = 0; d < D; d++) {
                    Lanes k[kKeyVecs];
                    for (int j = 0; j < kKeyVecs; j++)
                        k[j] = *reinterpret_cast<const Lanes *>(keys + d * kKeyTile + j * kLanes);
                    for (int64_t i = 0; i < kScoreRows; i++)
                        for (int j = 0; j < kKeyVecs; j++) acc[i][j] += queries[d * kScoreRows + i] * k[j];
                }
                for (int64_t i = 0; i < std::min(kScoreRows, rows - r0); i++) {
                    float *s = scores + (r0 + i) * B + (start - k0);
                    for (int j = 0; j < kKeyVecs; j++) *reinterpret_cast<Lanes *>(s + j * kLanes) = acc[i][j] * scale;
                }
            }
        }
        // the online softmax: each row's exponentials against its running maximum, its sum and its outputs
        // so far rescaled when the maximum grows
        for (int64_t r = 0; r < rows; r++) {
            float *s = scores + r * B;
            const int64_t seen = std::max<int64_t>(0, std::min(limit(r), k1) - k0);
            if (seen > 0) {
                const float top = max_of(s, seen);
                const float before = k0 == 0 ? top : most[r], now = std::max(before, top);
#pragma omp simd
                for (int64_t i = 0; i < seen; i++) s[i] = fast_exp(s[i] - now);
                const float sum = sum_of(s, seen);
                if (k0 == 0) {
                    total[r] = sum;
                } else {
                    const float shrink = fast_exp(before - now);
                    total[r] = total[r] * shrink + sum;
                    if (now > before) {
                        float *o = out_row(r);
                        for (int64_t c = 0; c < D; c++) o[c] *= shrink;
                    }
                }
                most[r] = now;
            }
            std::fill(s + seen, s + B, 0.0f);
        }
        // the weighted sum of these keys' values, added to out: the values stay in L1 while every row of
        // the tile adds them, C vectors of the head's columns at a time
        for (int64_t c0 = 0; c0 < D; c0 += C * kLanes)
            for (int64_t r0 = 0; r0 < rows; r0 += kValueRows) {
                const int64_t count = std::min(kValueRows, rows - r0);
                const int64_t end = std::min(k1, limit(r0 + count - 1));
                if (end <= k0) continue;  // these rows see none of these keys
                const float *weights[kValueRows];  // the rows of the tile past count: zeros (no branch per key)
                for (int64_t i = 0; i < kValueRows; i++) weights[i] = i < count ? scores + (r0 + i) * B : zeros;
                Lanes acc[kValueRows][C] = {};
                for (int64_t i = 0; i < count; i++)
                    for (int j = 0; j < C; j++)
                        acc[i][j] = *reinterpret_cast<const Lanes *>(out_row(r0 + i) + c0 + j * kLanes);
                for (int64_t b0 = k0; b0 < end;) {  // block by block: no division per key
                    const int64_t first = b0 / bs * bs, b1 = std::min(end, first + bs);
                    const KV *block = v + table[b0 / bs] * bs * row_size<KV>(D);
                    for (int64_t p = b0; p < b1; p++) {
                        const RowReader<KV> row(block + (p - first) * row_size<KV>(D), D);
                        Lanes value[C];
                        for (int j = 0; j < C; j++) value[j] = load_lanes(row, c0 + j * kLanes);
                        for (int64_t i = 0; i < kValueRows; i++) {
                            const float weight = weights[i][p - k0] * row.scale;
                            for (int j = 0; j < C; j++) acc[i][j] += weight * value[j];
                        }
                    }
                    b0 = b1;
                }
                for (int64_t i = 0; i < count; i++)
                    for (int j = 0; j < C; j++)
                        *reinterpret_cast<Lanes *>(out_row(r0 + i) + c0 + j * kLanes) = acc[i][j];
            }
    }
    for (int64_t r = 0; r < rows; r++) {
        float *o = out_row(r);
        const float inverse = 1.0f / total[r];
        for (int64_t c = 0; c < D; c++) o[c] *= inverse;
    }
}

// One layer's keys and values of every sequence's new token into the pool (kv: [layers][2][kv_heads]
// [slots][D] of KV), then attention() over them.
template <typename KV>
void write_and_attend(const Dims &d, const Batch &batch, KV *kv, int64_t layer, const float *qkv, int64_t qkv_size,
                      float *out, float *capture, int64_t capture_b) {
    const int64_t D = d.head_dim, q_size = d.heads * D, kv_size = d.kv_heads * D;
    const int64_t S = row_size<KV>(D);
    KV *keys = kv + (layer * 2 + 0) * d.kv_heads * d.num_slots * S, *values = keys + d.kv_heads * d.num_slots * S;
    for (int64_t b = 0; b < batch.size; b++) {
        const float *row = qkv + b * qkv_size;
        const int64_t slot = batch.slot(d, b, batch.positions[b]);
        for (int64_t g = 0; g < d.kv_heads; g++) {
            store_row(keys + (g * d.num_slots + slot) * S, row + q_size + g * D, D);
            store_row(values + (g * d.num_slots + slot) * S, row + q_size + kv_size + g * D, D);
        }
    }
    attention(d, batch, qkv, qkv_size, keys, values, out, capture, capture_b);
}

// ps_prefill_attention for one KV format.
template <typename KV>
void prefill_attention(const int64_t *dims, const float *qkv, int64_t q_stride, KV *keys, KV *values,
                       const int64_t *table, int64_t pos, int64_t T, float *out) {
    const float *q = qkv;
    const int64_t heads = dims[0], kv_heads = dims[1], D = dims[2], num_slots = dims[3], bs = dims[4];
    const int64_t group = heads / kv_heads, tiles = (T + kTileTokens - 1) / kTileTokens;
    const float scale = 1.0f / std::sqrt(float(D));
    const int64_t n = pos + T, key_tiles = (n + kKeyTile - 1) / kKeyTile, group_keys = key_tiles * kKeyTile * D;
    const int64_t S = row_size<KV>(D);
    float *kt = scratch(2, kv_heads * group_keys);  // each group's keys transposed once, for all its tiles
#pragma omp parallel num_threads(dims[5])
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {  // the chunk's keys and values into the pool
            const int64_t p = pos + t, slot = table[p / bs] * bs + p % bs;
            const float *row = qkv + t * q_stride + heads * D;  // key heads, then value heads
            for (int64_t g = 0; g < kv_heads; g++) {
                store_row(keys + (g * num_slots + slot) * S, row + g * D, D);
                store_row(values + (g * num_slots + slot) * S, row + (kv_heads + g) * D, D);
            }
        }
#pragma omp for schedule(static)
        for (int64_t task = 0; task < kv_heads * key_tiles; task++) {
            const int64_t g = task / key_tiles;
            transpose_keys(keys + g * num_slots * S, table, bs, D, n, task % key_tiles, kt + g * group_keys);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < kv_heads * tiles; task++) {  // later tiles see more keys: dynamic
            const int64_t g = task % kv_heads, t0 = task / kv_heads * kTileTokens;
            const int64_t t1 = std::min(T, t0 + kTileTokens);
            const float *k = kt + g * group_keys;
            const KV *v = values + g * num_slots * S;
            if (D == 64)
                attend_prefill_tile<64, KV>(q + g * group * D, q_stride, group, k, v, table, bs, pos, t0, t1, scale,
                                            out + g * group * D, heads * D);
            else
                attend_prefill_tile<128, KV>(q + g * group * D, q_stride, group, k, v, table, bs, pos, t0, t1, scale,
                                             out + g * group * D, heads * D);
        }
    }
}

}  // namespace

// The KV-cache formats this build reads and writes: bit 0 fp32, bit 1 fp16, bit 2 int8.
extern "C" int ps_kv_formats() { return 1 | (kHasHalf ? 2 : 0) | 4; }

// Wakes the calling thread's OpenMP team (PyTorch's ops use the same one) and returns the milliseconds it
// took: empty parallel regions until one comes back at once (the threads spinning, ready), or 100 ms. Found
// timing the explain mode's stages on a 2-core VM: a step after a pause of a tenth of a second or more
// waited 4-25 ms, in whole 4-ms scheduler ticks, for its second thread (woken onto the first one's CPU, it
// ran when that one's time slice ended), all of it in layer 0's attention: 10.7 ms against 1.5 ms back to back.
extern "C" double ps_wake_threads(int64_t threads) {
    const auto began = std::chrono::steady_clock::now();
    const auto since = [](std::chrono::steady_clock::time_point t) {
        return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
    };
    while (threads > 1 && since(began) < 100.0) {
        const auto start = std::chrono::steady_clock::now();
        std::atomic<int64_t> answered{0};  // a region with nothing in it, the compiler leaves out
#pragma omp parallel num_threads(threads)
        answered.fetch_add(1, std::memory_order_relaxed);
        if (since(start) < 0.05) break;  // an awake team answers in a few microseconds
    }
    return since(began);
}

// Binds each thread of the calling thread's OpenMP team (PyTorch's ops use the same one) to a CPU of its
// own, thread i to the i-th CPU the process may run on (on = 1), or lets them run on any of those again
// (on = 0). Returns how many CPUs that is, or -1 where a thread could not be moved. Found on a 2-core VM
// with another program busy on one core: threads left free were both put on the other core, where each
// waited for the other at every barrier (a 35-token prefill 133 ms against 23 bound, decode 59 against 89
// tokens/s). The team's threads stay the same from one region to the next (libgomp keeps its pool).
extern "C" int64_t ps_bind_threads(int64_t threads, int64_t on) {
    static cpu_set_t allowed;  // the process's CPUs, read once: later the calling thread may be bound itself
    static const bool read = sched_getaffinity(0, sizeof allowed, &allowed) == 0;
    if (!read) return -1;
    std::vector<int> cpus;
    for (int cpu = 0; cpu < CPU_SETSIZE; cpu++)
        if (CPU_ISSET(cpu, &allowed)) cpus.push_back(cpu);
    int64_t failed = 0;
#pragma omp parallel num_threads(threads) reduction(+ : failed)
    {
        cpu_set_t mine = allowed;
        if (on) {
            CPU_ZERO(&mine);
            CPU_SET(cpus[omp_get_thread_num() % cpus.size()], &mine);
        }
        failed += sched_setaffinity(0, sizeof mine, &mine) != 0;  // 0: the calling thread
    }
    return failed ? -1 : static_cast<int64_t>(cpus.size());
}

// dims: Dims as 13 int64; layer_ptrs: per layer 14 addresses (qkv, o, gate_up, down as weight, scale,
// bias; then attn_norm, mlp_norm); model_ptrs: embed [vocab][hidden], final_norm, lm_head weight, scale,
// bias, cos [positions][D/2], sin [positions][D/2]. For each of the n sequences: tokens[b] at
// positions[b], block table row b of tables [n][table_stride]. Writes each one's K/V at its position and
// logits [n][vocab]. capture: null, or [layers][heads][positions[capture_b] + 1] for the attention weights
// of sequence capture_b (the explain mode). stage_ms: null, or kNumStages doubles to which the wall time
// of each stage of the step is added (the explain mode's pipeline). rope_positions: null, or each
// token's position for the rotary embedding where it is not its place in the cache (a sliding window
// dropped tokens before it). Returns 0, or 1 for an input out of range (nothing is written then).
// kWake: the time the threads took to wake before the step (ps_wake_threads), not one of its stages.
enum Stage { kEmbedding, kNorm, kAttention, kFfn, kFinalNorm, kLmHead, kWake, kNumStages };

// Adds the time since the previous lap to one stage; does nothing without a place to add it to.
struct StageClock {
    double *ms;
    std::chrono::steady_clock::time_point last = std::chrono::steady_clock::now();
    void lap(Stage stage) {
        if (ms == nullptr) return;
        const auto now = std::chrono::steady_clock::now();
        ms[stage] += std::chrono::duration<double, std::milli>(now - last).count();
        last = now;
    }
};

extern "C" int ps_decode_batch(const int64_t *dims, float eps, const int64_t *layer_ptrs, const int64_t *model_ptrs,
                               void *kv, int64_t n, const int64_t *tokens, const int64_t *positions,
                               const int64_t *tables, int64_t table_stride, float *logits, float *capture,
                               int64_t capture_b, double *stage_ms, const int64_t *rope_positions) {
    const Dims d{dims[0], dims[1], dims[2], dims[3], dims[4], dims[5], dims[6], dims[7], dims[8], dims[9], dims[10],
                 dims[11], dims[12]};
    const Batch batch{n, tokens, positions, tables, table_stride};
    for (int64_t b = 0; b < n; b++) {
        if (tokens[b] < 0 || tokens[b] >= d.vocab || positions[b] < 0 || positions[b] / d.block_size >= table_stride)
            return 1;
        const int64_t block = tables[b * table_stride + positions[b] / d.block_size];
        if (block < 0 || (block + 1) * d.block_size > d.num_slots) return 1;
    }
    const int64_t C = d.hidden, D = d.head_dim, I = d.intermediate;
    const int64_t q_size = d.heads * D, kv_size = d.kv_heads * D, qkv_size = q_size + 2 * kv_size;
    std::vector<float> x(n * C), h(n * C), qkv(n * qkv_size), attn(n * q_size), proj(n * C), gate_up(n * 2 * I),
        act(n * I);
    auto ptr = [](int64_t address) { return reinterpret_cast<const float *>(address); };
    if (stage_ms != nullptr) stage_ms[kWake] = ps_wake_threads(d.threads);  // else in layer 0's attention
    StageClock clock{stage_ms};
    for (int64_t b = 0; b < n; b++) std::memcpy(x.data() + b * C, ptr(model_ptrs[0]) + tokens[b] * C, C * sizeof(float));
    clock.lap(kEmbedding);
    for (int64_t l = 0; l < d.layers; l++) {
        const int64_t *p = layer_ptrs + l * 14;
        const Linear qkv_proj{ptr(p[0]), ptr(p[1]), ptr(p[2])}, o_proj{ptr(p[3]), ptr(p[4]), ptr(p[5])};
        const Linear gate_up_proj{ptr(p[6]), ptr(p[7]), ptr(p[8])}, down_proj{ptr(p[9]), ptr(p[10]), ptr(p[11])};
        // attention block
        for (int64_t b = 0; b < n; b++) rms_norm(x.data() + b * C, ptr(p[12]), C, eps, h.data() + b * C);
        clock.lap(kNorm);
        linear(d, qkv_proj, h.data(), n, C, qkv_size, qkv.data());
        for (int64_t b = 0; b < n; b++) {
            float *row = qkv.data() + b * qkv_size;
            const int64_t pos = rope_positions ? rope_positions[b] : positions[b];
            rotary(row, d.heads + d.kv_heads, D, ptr(model_ptrs[5]) + pos * (D / 2), ptr(model_ptrs[6]) + pos * (D / 2));
        }
        float *layer_capture = capture ? capture + l * d.heads * (positions[capture_b] + 1) : nullptr;
        float *a = attn.data();
        if (d.kv_format == kF16)
            write_and_attend(d, batch, static_cast<half *>(kv), l, qkv.data(), qkv_size, a, layer_capture, capture_b);
        else if (d.kv_format == kQ8)
            write_and_attend(d, batch, static_cast<q8 *>(kv), l, qkv.data(), qkv_size, a, layer_capture, capture_b);
        else
            write_and_attend(d, batch, static_cast<float *>(kv), l, qkv.data(), qkv_size, a, layer_capture, capture_b);
        linear(d, o_proj, attn.data(), n, q_size, C, proj.data());
        for (int64_t i = 0; i < n * C; i++) x[i] += proj[i];
        clock.lap(kAttention);
        // MLP block
        for (int64_t b = 0; b < n; b++) rms_norm(x.data() + b * C, ptr(p[13]), C, eps, h.data() + b * C);
        clock.lap(kNorm);
        linear(d, gate_up_proj, h.data(), n, C, 2 * I, gate_up.data());
        for (int64_t b = 0; b < n; b++) {
            const float *gate = gate_up.data() + b * 2 * I, *up = gate + I;
            float *a = act.data() + b * I;
#pragma omp simd
            for (int64_t i = 0; i < I; i++) a[i] = gate[i] / (1.0f + fast_exp(-gate[i])) * up[i];  // SiLU(gate) * up
        }
        linear(d, down_proj, act.data(), n, I, C, proj.data());
        for (int64_t i = 0; i < n * C; i++) x[i] += proj[i];
        clock.lap(kFfn);
    }
    for (int64_t b = 0; b < n; b++) rms_norm(x.data() + b * C, ptr(model_ptrs[1]), C, eps, h.data() + b * C);
    clock.lap(kFinalNorm);
    const Linear lm_head{ptr(model_ptrs[2]), ptr(model_ptrs[3]), ptr(model_ptrs[4])};
    linear(d, lm_head, h.data(), n, C, d.vocab, logits);
    clock.lap(kLmHead);
    return 0;
}

// Attention of a prefill chunk: tokens at positions [pos, pos + T) of one sequence's cache. dims: heads,
// kv_heads, head_dim, num_slots, block_size, threads, kv_format (KvFormat). qkv [T] rows of q_stride
// floats: the query heads, then the key heads, then the value heads (q and k pair-rotated); the chunk's
// keys and values are written into keys, values (one layer's [kv_heads][slots][row]) at the sequence's
// slots, then every token attends over positions [0, its own]. table: the sequence's block ids; out [T][heads * D]. Returns 0, or
// 1 for a head dimension it has no kernel for (64 and 128 only; the caller then uses PyTorch's).
extern "C" int ps_prefill_attention(const int64_t *dims, const float *qkv, int64_t q_stride, void *keys,
                                    void *values, const int64_t *table, int64_t pos, int64_t T, float *out) {
    if (dims[2] != 64 && dims[2] != 128) return 1;
    if (dims[6] == kF16)
        prefill_attention(dims, qkv, q_stride, static_cast<half *>(keys), static_cast<half *>(values), table, pos, T, out);
    else if (dims[6] == kQ8)
        prefill_attention(dims, qkv, q_stride, static_cast<q8 *>(keys), static_cast<q8 *>(values), table, pos, T, out);
    else
        prefill_attention(dims, qkv, q_stride, static_cast<float *>(keys), static_cast<float *>(values), table, pos, T,
                          out);
    return 0;
}

// y [n][out] = x [n][in] W^T * scale (+ bias) for a prefill's n rows, W int8 in the layout this build
// reads (ps_int8_row_group) with a scale per row, x quantized per block of 64 as the decode step quantizes
// it: the decode step's int8 rows, without a second copy of the weights in another library's layout.
extern "C" void ps_linear_int8(const float *x, int64_t n, int64_t in, int64_t out, const void *w, const float *scale,
                               const float *bias, int64_t threads, float *y) {
    Dims d{};
    d.is_int8 = 1;
    d.threads = threads;
    linear(d, Linear{w, scale, bias}, x, n, in, out, y, /*tiled=*/true);
}

// How this build reads int8 weights: 16 (AVX-512), rows packed 16 at a time by ps_pack_int8; 0, the rows
// as they are, output-major [out][in].
extern "C" int64_t ps_int8_row_group() { return kRowGroup; }

// The int8 rows w [out][in] packed for this build (see packed_block_int8) into packed [ceil(out / 16) * 16 *
// in] bytes: for each group of 16 rows and each 4 inputs, those 4 inputs of the 16 rows, plus 128.
extern "C" void ps_pack_int8(const int8_t *w, int64_t out, int64_t in, int64_t threads, uint8_t *packed) {
    const int64_t groups = (out + 15) / 16;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < groups; g++)
        for (int64_t step = 0; step < in; step += 4)
            for (int64_t i = 0; i < 16; i++) {
                const int64_t row = g * 16 + i;
                uint32_t four = 0;  // rows past the end: w = 0
                if (row < out) std::memcpy(&four, w + row * in + step, 4);
                four ^= 0x80808080u;  // + 128 in each byte
                std::memcpy(packed + (g * in + step) * 16 + i * 4, &four, 4);
            }
}

namespace {

// The k largest of logits [n] (ids and values, largest first; ties go to the lower id, as argmax does;
// NaN never wins; -1 and -inf where fewer than k are above -inf).
void largest(const float *logits, int64_t n, int64_t k, int64_t *ids, float *values) {
    for (int64_t j = 0; j < k; j++) ids[j] = -1, values[j] = -INFINITY;
    constexpr int64_t kStretch = 64;  // a stretch's maximum (vectorized) decides whether to look closer
    for (int64_t i0 = 0; i0 < n; i0 += kStretch) {
        const int64_t i1 = std::min(n, i0 + kStretch);
        float most = -INFINITY;
        if (i1 - i0 == kStretch) {  // in vectors (GCC had left the reduction below scalar: 27 us of 49,152)
            Vec top = -INFINITY - Vec{};
            for (int64_t i = i0; i < i1; i += 8) {
                const Vec x = *reinterpret_cast<const Vec *>(logits + i);
                top = x > top ? x : top;  // NaN never wins
            }
            for (int j = 0; j < 8; j++) most = std::max(most, top[j]);
        } else {
            for (int64_t i = i0; i < i1; i++) most = std::max(most, logits[i]);  // NaN never wins
        }
        if (!(most > values[k - 1])) continue;
        for (int64_t i = i0; i < i1; i++) {
            const float v = logits[i];
            if (!(v > values[k - 1])) continue;
            int64_t j = k - 1;
            for (; j > 0 && v > values[j - 1]; j--) ids[j] = ids[j - 1], values[j] = values[j - 1];
            ids[j] = i, values[j] = v;
        }
    }
}

// log(sum(exp((logits - top) * scale))): top the largest logit, so that no term overflows (NaN where a
// logit is NaN)
float log_sum_exp_below(const float *logits, int64_t n, float top, float scale) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; i++) sum += fast_exp((logits[i] - top) * scale);
    return std::log(sum);
}

}  // namespace

// What sampling and the events need from a step's logits: the k largest (ids and values, largest first;
// ties go to the lower id, as argmax does) and log(sum(exp(logits))), so that any token's probability
// is exp(logit - lse). Two passes over [n], on one thread: 15 µs for n = 49,152 (AVX-512).
extern "C" float ps_top_logits(const float *logits, int64_t n, int64_t k, int64_t *ids, float *values) {
    largest(logits, n, k, ids, values);
    return values[0] + log_sum_exp_below(logits, n, values[0], 1.0f);
}

// The same under a temperature, for sampling (scale = 1 / temperature): the k largest logits as they are
// (the most likely under any temperature), and log(sum(exp((logits - top) * scale))) with top the largest,
// so that token i's probability is exp((logit_i - top) * scale - the result), with no logits / temperature
// made over the vocabulary first.
extern "C" float ps_top_tempered(const float *logits, int64_t n, int64_t k, float scale, int64_t *ids, float *values) {
    largest(logits, n, k, ids, values);
    return log_sum_exp_below(logits, n, values[0], scale);
}

// The repetition penalty (CTRL's, sampling.apply_repetition_penalty) into out: the logits [n] copied, then
// each of the ids' logits divided by the penalty where positive, else multiplied (NaN stays NaN); ids
// outside [0, n) are passed over. One call where PyTorch made a copy and six ops on the ids, each slow in
// the engine with its code cold after the forward: 40-60 µs less of each sampled token there (int8).
extern "C" void ps_penalized(const float *logits, int64_t n, const int64_t *ids, int64_t count, float penalty,
                             float *out) {
    std::memcpy(out, logits, sizeof(float) * n);
    for (int64_t i = 0; i < count; i++) {
        const int64_t id = ids[i];
        if (id < 0 || id >= n) continue;
        const float value = logits[id];
        out[id] = value > 0.0f ? value / penalty : value * penalty;
    }
}

// Top-p over the whole vocabulary, for the draws where the 64 most likely tokens hold less than top_p (a
// third of the bundled model's at temperature 0.7 in a long chat): the tokens, most likely first (ties:
// the lower id), that top-p keeps under temperature 1 / scale (each kept while the tokens above it hold
// less than top_p), their ids and probabilities; returns how many, or -1 where it cannot say (NaN scores,
// more than cap tokens, or a nucleus reaching past exp(-kReach) of the most likely's probability). Without
// sorting the vocabulary: each token's probability into a histogram of (top - score) * scale, whose
// running sum finds the bucket top-p ends in; the tokens up to it are sorted.
extern "C" int64_t ps_nucleus(const float *scores, int64_t n, float scale, float top_p, int64_t cap, int64_t *ids,
                              float *probs) {
    constexpr int kBuckets = 2048;
    constexpr float kReach = 16.0f;  // in nats below the most likely token (the bundled model's nuclei end within 10)
    constexpr float kPerNat = kBuckets / kReach;
    if (n < 1 || n > (1 << 17)) return -1;  // ids and buckets share an int32 below
    const float top = max_of(scores, n);  // the attention's (NaN where the first is; any other, the sum finds)
    if (!std::isfinite(top)) return -1;
    // kept from call to call, as a decode step's buffers are (a fresh 196 KB was mapped and faulted in a call)
    static thread_local std::vector<float> e;  // exp((score - top) * scale)
    static thread_local std::vector<int32_t> near;  // the tokens within kReach of the most likely
    static thread_local std::vector<std::pair<float, int64_t>> kept;  // (score, id) of those up to top-p's end
    e.resize(n);
    near.resize(n + 16);
    float *ex = e.data();
    double sum = 0.0;  // in double, as the running sums below: top-p's limit is a share of it
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; t++) sum += (ex[t] = fast_exp((scores[t] - top) * scale));
    if (!(sum > 0.0) || !std::isfinite(sum)) return -1;
    const float within = top - kReach / scale;
    int64_t m = 0, t = 0;
#if defined(__AVX512F__)
    const __m512 bar = _mm512_set1_ps(within);
    const __m512i sixteen = _mm512_set1_epi32(16);
    __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (; t + 16 <= n; t += 16, at = _mm512_add_epi32(at, sixteen)) {  // the near ones' ids, packed
        const __mmask16 is_near = _mm512_cmp_ps_mask(_mm512_loadu_ps(scores + t), bar, _CMP_GT_OQ);
        // compressed in a register, then stored whole: a compressing store to memory is microcoded on AMD's
        // Zen 4 (68 us for the vocabulary, against 30 for the scalar loop); near has 16 ids to spare
        _mm512_storeu_si512(near.data() + m, _mm512_maskz_compress_epi32(is_near, at));
        m += __builtin_popcount(is_near);
    }
#endif
    for (; t < n; t++) {  // without a branch: a fifth to a third of the vocabulary is near
        near[m] = int32_t(t);
        m += scores[t] > within;
    }
    // each near token's probability into a histogram of its distance below the most likely, in nats
    double mass[kBuckets] = {};
    for (int64_t j = 0; j < m; j++) {
        const int32_t id = near[j];
        const int b = std::min(kBuckets - 1, int((top - scores[id]) * scale * kPerNat));
        mass[b] += ex[id];
        near[j] = id | b << 17;  // its bucket beside its id (a vocabulary of 2^17 at most: see below)
    }
    const double limit = double(top_p) * sum;
    double above = 0.0;
    int last = 0;  // the bucket top-p ends in: its tokens are sorted to find where
    while (last < kBuckets && above + mass[last] < limit) above += mass[last++];
    if (last == kBuckets) return -1;  // the nucleus reaches past kReach
    kept.clear();  // up to the bucket after `last`, should the sums in token order round below the buckets'
    for (int64_t j = 0; j < m; j++)
        if ((near[j] >> 17) <= last + 1) kept.emplace_back(scores[near[j] & 0x1ffff], near[j] & 0x1ffff);
    std::sort(kept.begin(), kept.end(), [](const auto &a, const auto &b) {
        return a.first > b.first || (a.first == b.first && a.second < b.second);
    });
    double held = 0.0;
    int64_t count = 0;
    for (const auto &[score, id] : kept) {
        if (count > 0 && held >= limit) break;  // the most likely always stays
        if (count == cap) return -1;
        ids[count] = id;
        probs[count] = float(ex[id] / sum);
        held += ex[id];
        count++;
    }
    return count;
}

// The same for each of n rows of logits [n][vocab] (a decode step's batch), rows spread over the threads;
// lse [n], ids and values [n][k].
extern "C" void ps_top_logits_batch(const float *logits, int64_t n, int64_t vocab, int64_t k, int64_t threads,
                                    int64_t *ids, float *values, float *lse) {
#pragma omp parallel for num_threads(threads) schedule(static) if (n > 1)
    for (int64_t b = 0; b < n; b++) lse[b] = ps_top_logits(logits + b * vocab, vocab, k, ids + b * k, values + b * k);
}
