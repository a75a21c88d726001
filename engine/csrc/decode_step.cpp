// One decode step of a Llama-family model for one sequence, as a single call: the whole T = 1 forward
// (embedding row, per layer RMSNorm -> QKV -> rotary -> KV cache write -> attention -> O -> residual ->
// RMSNorm -> gate/up -> SiLU * up -> down -> residual, then the final norm and the LM head).
//
// Why: a decode step moves every weight once and does little arithmetic per byte, so it should run at
// memory bandwidth. In eager PyTorch it does not: ~25 small ops per layer each pay dispatch and thread
// start-up, which on 2 cores was more than half of the step. Here the small ops are plain loops on one
// thread and only the matrix-vector products use the OpenMP team (torch's own libgomp, already loaded).
//
// Layouts (made by engine/fused.py from the LeanLlama weights):
//   fp32 linear weights input-major W[in][out]; int8 ones output-major W[out][in], one fp32 scale per row;
//   q/k rows paired per head, (x_i, x_{i+D/2}) adjacent, so the rotary embedding is a complex product;
//   kv cache [layers][2][kv_heads][capacity][head_dim] fp32, the same tensor the PyTorch path fills.
// No torch headers: built with g++ in about a second and called through ctypes.
#include <omp.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// exp(x) for the softmaxes and SiLU, written so that loops over it vectorize (the C library's expf
// is a scalar call without -ffast-math): 2^n * e^r with |r| <= ln2/2, a degree-6 polynomial for e^r.
// Relative error ~2e-7; x below -87 flushes to 0, which only ever meets probabilities and gates.
#pragma omp declare simd
inline float fast_exp(float x) {
    x = std::min(std::max(x, -87.0f), 88.0f);
    const float n = std::nearbyint(x * 1.44269504f);
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
    const void *weight;  // float [in][out], or int8_t [out][in]
    const float *scale;  // [out] for int8, else null
    const float *bias;   // [out] or null
};

struct Dims {
    int64_t layers, heads, kv_heads, head_dim, hidden, intermediate, vocab, capacity, is_int8, threads;
};

// y[c0:c1] = x . W[:, c0:c1] on one thread, W fp32 input-major [in][out], four input rows at a time.
void matvec_columns(const float *x, const float *w, int64_t in, int64_t out, int64_t c0, int64_t c1, float *y) {
    float *acc = y + c0;
    const int64_t n = c1 - c0;
    std::fill(acc, acc + n, 0.0f);
    int64_t i = 0;
    for (; i + 4 <= in; i += 4) {
        const float *w0 = w + i * out + c0, *w1 = w0 + out, *w2 = w1 + out, *w3 = w2 + out;
        const float x0 = x[i], x1 = x[i + 1], x2 = x[i + 2], x3 = x[i + 3];
#pragma omp simd
        for (int64_t c = 0; c < n; c++) acc[c] += x0 * w0[c] + x1 * w1[c] + x2 * w2[c] + x3 * w3[c];
    }
    for (; i < in; i++) {
        const float *w0 = w + i * out + c0;
        const float x0 = x[i];
#pragma omp simd
        for (int64_t c = 0; c < n; c++) acc[c] += x0 * w0[c];
    }
}

// int8 x int8 matrix-vector products. x is quantized per step in blocks of 64 inputs, each with its own
// scale (like llama.cpp's Q8 activations), so one outlier only coarsens its own block. Kept as |x| and
// the sign of x, so that the products are unsigned x signed bytes (vpdpbusd, or maddubs on AVX2) without
// saturating; the sign moves onto the weight.
constexpr int64_t kBlock = 64;

struct QuantizedX {
    std::vector<uint8_t> magnitude;  // |round(x / scale)|, <= 127
    std::vector<int8_t> sign;        // +1 / -1 (0 where x is 0)
    std::vector<float> scale;        // one per block of 64 inputs
};

QuantizedX quantize_blocks(const float *x, int64_t in) {
    QuantizedX q{std::vector<uint8_t>(in), std::vector<int8_t>(in), std::vector<float>(in / kBlock)};
    for (int64_t b = 0; b < in / kBlock; b++) {
        float top = 0.0f;
        for (int64_t i = b * kBlock; i < (b + 1) * kBlock; i++) top = std::max(top, std::fabs(x[i]));
        const float scale = top / 127.0f, inverse = top > 0.0f ? 127.0f / top : 0.0f;
        q.scale[b] = scale;
        for (int64_t i = b * kBlock; i < (b + 1) * kBlock; i++) {
            const int v = int(std::lrint(x[i] * inverse));
            q.magnitude[i] = uint8_t(std::abs(v));
            q.sign[i] = int8_t(v > 0 ? 1 : v < 0 ? -1 : 0);
        }
    }
    return q;
}

// sum over the block of x_q[i] * w[i], from |x_q| and sign(x_q)
inline int32_t block_dot(const QuantizedX &q, int64_t start, const int8_t *w) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    const __m512i magnitude = _mm512_loadu_si512(q.magnitude.data() + start);
    const __mmask64 negative = _mm512_movepi8_mask(_mm512_loadu_si512(q.sign.data() + start));
    __m512i weights = _mm512_loadu_si512(w);
    weights = _mm512_mask_sub_epi8(weights, negative, _mm512_setzero_si512(), weights);
    return _mm512_reduce_add_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), magnitude, weights));
#elif defined(__AVX2__)
    __m256i total = _mm256_setzero_si256();
    for (int64_t half = 0; half < kBlock; half += 32) {
        const __m256i magnitude = _mm256_loadu_si256((const __m256i *)(q.magnitude.data() + start + half));
        const __m256i sign = _mm256_loadu_si256((const __m256i *)(q.sign.data() + start + half));
        const __m256i weights = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(w + half)), sign);
        const __m256i pairs = _mm256_maddubs_epi16(magnitude, weights);  // <= 2 * 127 * 127: no saturation
        total = _mm256_add_epi32(total, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
    }
    __m128i sum = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    sum = _mm_hadd_epi32(sum, sum);
    return _mm_cvtsi128_si32(_mm_hadd_epi32(sum, sum));
#else
    int32_t total = 0;
    for (int64_t i = 0; i < kBlock; i++) total += int32_t(q.magnitude[start + i]) * q.sign[start + i] * w[i];
    return total;
#endif
}

// y[r0:r1] = (W[r0:r1, :] . x) with W int8 output-major [out][in]; before the per-row weight scale.
void matvec_int8_rows(const QuantizedX &q, const int8_t *w, int64_t in, int64_t r0, int64_t r1, float *y) {
    for (int64_t r = r0; r < r1; r++) {
        const int8_t *row = w + r * in;
        float total = 0.0f;
        for (int64_t b = 0; b < in / kBlock; b++)
            total += q.scale[b] * float(block_dot(q, b * kBlock, row + b * kBlock));
        y[r] = total;
    }
}

// fp32 weights whose rows are only a few KB: split over the team by input rows instead, each thread
// summing its stretch into partial sums that are added up at the end. Splitting columns there had both
// threads reading halves of the same short rows, which streamed at half the bandwidth (measured).
constexpr int64_t kNarrowColumns = 2048;

void linear_split_inputs(const Dims &d, const Linear &lin, const float *x, int64_t in, int64_t out, float *y) {
    std::vector<float> partial(d.threads * out, 0.0f);
#pragma omp parallel num_threads(d.threads)
    {
        const int64_t team = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t per = ((in + team - 1) / team + 3) / 4 * 4;
        const int64_t i0 = std::min(in, t * per), i1 = std::min(in, i0 + per);
        if (i0 < i1)
            matvec_columns(x + i0, static_cast<const float *>(lin.weight) + i0 * out, i1 - i0, out, 0, out,
                           partial.data() + t * out);
    }
    for (int64_t c = 0; c < out; c++) {
        float total = lin.bias ? lin.bias[c] : 0.0f;
        for (int64_t t = 0; t < d.threads; t++) total += partial[t * out + c];
        y[c] = total;
    }
}

// y = x W (* scale) (+ bias). Each thread streams one contiguous stretch of the weights: a range of
// output rows (int8, output-major), a range of output columns (wide fp32), or of input rows (narrow fp32).
void linear(const Dims &d, const Linear &lin, const float *x, int64_t in, int64_t out, float *y) {
    if (!d.is_int8 && out < kNarrowColumns) return linear_split_inputs(d, lin, x, in, out, y);
    const QuantizedX q = d.is_int8 ? quantize_blocks(x, in) : QuantizedX{};
#pragma omp parallel num_threads(d.threads)
    {
        const int64_t team = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t per = ((out + team - 1) / team + 15) / 16 * 16;
        const int64_t c0 = std::min(out, t * per), c1 = std::min(out, c0 + per);
        if (c0 < c1) {
            if (d.is_int8)
                matvec_int8_rows(q, static_cast<const int8_t *>(lin.weight), in, c0, c1, y);
            else
                matvec_columns(x, static_cast<const float *>(lin.weight), in, out, c0, c1, y);
            for (int64_t c = c0; c < c1; c++) {
                if (lin.scale) y[c] *= lin.scale[c];
                if (lin.bias) y[c] += lin.bias[c];
            }
        }
    }
}

void rms_norm(const float *x, const float *weight, int64_t n, float eps, float *y) {
    double sum = 0.0;
    for (int64_t i = 0; i < n; i++) sum += double(x[i]) * x[i];
    const float inv = 1.0f / std::sqrt(float(sum / n) + eps);
    for (int64_t i = 0; i < n; i++) y[i] = x[i] * inv * weight[i];
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

// out[h] = softmax(q_h . K^T / sqrt(D)) V over positions [0, n) of the head's KV group.
void attention(const Dims &d, const float *q, const float *keys, const float *values, int64_t n, float *out) {
    const int64_t D = d.head_dim, group = d.heads / d.kv_heads;
    const float scale = 1.0f / std::sqrt(float(D));
    std::vector<float> scores(d.heads * n);
#pragma omp parallel for num_threads(d.threads) schedule(static)
    for (int64_t h = 0; h < d.heads; h++) {
        const float *qh = q + h * D;
        const float *k = keys + (h / group) * d.capacity * D, *v = values + (h / group) * d.capacity * D;
        float *s = scores.data() + h * n, *o = out + h * D;
        float top = -INFINITY;
        for (int64_t t = 0; t < n; t++) {
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t i = 0; i < D; i++) dot += qh[i] * k[t * D + i];
            s[t] = dot * scale;
            top = std::max(top, s[t]);
        }
        float total = 0.0f;
#pragma omp simd reduction(+ : total)
        for (int64_t t = 0; t < n; t++) total += (s[t] = fast_exp(s[t] - top));
        std::fill(o, o + D, 0.0f);
        for (int64_t t = 0; t < n; t++) {
            const float p = s[t] / total;
#pragma omp simd
            for (int64_t i = 0; i < D; i++) o[i] += p * v[t * D + i];
        }
    }
}

}  // namespace

// dims: Dims as 10 int64; layer_ptrs: per layer 14 addresses (qkv, o, gate_up, down as weight, scale,
// bias; then attn_norm, mlp_norm); model_ptrs: embed [vocab][hidden], final_norm, lm_head weight, scale,
// bias, cos [positions][D/2], sin [positions][D/2]. Writes K/V of position pos and logits [vocab].
extern "C" int ps_decode_step(const int64_t *dims, float eps, const int64_t *layer_ptrs, const int64_t *model_ptrs,
                              float *kv, int64_t token, int64_t pos, float *logits) {
    const Dims d{dims[0], dims[1], dims[2], dims[3], dims[4], dims[5], dims[6], dims[7], dims[8], dims[9]};
    if (pos < 0 || pos >= d.capacity || token < 0 || token >= d.vocab) return 1;
    const int64_t C = d.hidden, D = d.head_dim, I = d.intermediate;
    const int64_t q_size = d.heads * D, kv_size = d.kv_heads * D;
    std::vector<float> x(C), h(C), qkv(q_size + 2 * kv_size), attn(q_size), proj(C), gate_up(2 * I);
    auto ptr = [](int64_t address) { return reinterpret_cast<const float *>(address); };
    std::memcpy(x.data(), ptr(model_ptrs[0]) + token * C, C * sizeof(float));
    const float *cos = ptr(model_ptrs[5]) + pos * (D / 2), *sin = ptr(model_ptrs[6]) + pos * (D / 2);
    for (int64_t l = 0; l < d.layers; l++) {
        const int64_t *p = layer_ptrs + l * 14;
        const Linear qkv_proj{ptr(p[0]), ptr(p[1]), ptr(p[2])}, o_proj{ptr(p[3]), ptr(p[4]), ptr(p[5])};
        const Linear gate_up_proj{ptr(p[6]), ptr(p[7]), ptr(p[8])}, down_proj{ptr(p[9]), ptr(p[10]), ptr(p[11])};
        // attention block
        rms_norm(x.data(), ptr(p[12]), C, eps, h.data());
        linear(d, qkv_proj, h.data(), C, q_size + 2 * kv_size, qkv.data());
        rotary(qkv.data(), d.heads + d.kv_heads, D, cos, sin);
        float *keys = kv + (l * 2 + 0) * d.kv_heads * d.capacity * D, *values = keys + d.kv_heads * d.capacity * D;
        for (int64_t g = 0; g < d.kv_heads; g++) {
            std::memcpy(keys + (g * d.capacity + pos) * D, qkv.data() + q_size + g * D, D * sizeof(float));
            std::memcpy(values + (g * d.capacity + pos) * D, qkv.data() + q_size + kv_size + g * D, D * sizeof(float));
        }
        attention(d, qkv.data(), keys, values, pos + 1, attn.data());
        linear(d, o_proj, attn.data(), q_size, C, proj.data());
        for (int64_t i = 0; i < C; i++) x[i] += proj[i];
        // MLP block
        rms_norm(x.data(), ptr(p[13]), C, eps, h.data());
        linear(d, gate_up_proj, h.data(), C, 2 * I, gate_up.data());
        float *gate = gate_up.data(), *up = gate + I;
#pragma omp simd
        for (int64_t i = 0; i < I; i++) gate[i] = gate[i] / (1.0f + fast_exp(-gate[i])) * up[i];  // SiLU(gate) * up
        linear(d, down_proj, gate_up.data(), I, C, proj.data());
        for (int64_t i = 0; i < C; i++) x[i] += proj[i];
    }
    rms_norm(x.data(), ptr(model_ptrs[1]), C, eps, h.data());
    const Linear lm_head{ptr(model_ptrs[2]), ptr(model_ptrs[3]), ptr(model_ptrs[4])};
    linear(d, lm_head, h.data(), C, d.vocab, logits);
    return 0;
}

// What sampling and the events need from a step's logits: the k largest (ids and values, largest first;
// ties go to the lower id, as argmax does) and log(sum(exp(logits))), so that any token's probability
// is exp(logit - lse). Two passes over [n], on one thread: a few microseconds for n = 49,152.
extern "C" float ps_top_logits(const float *logits, int64_t n, int64_t k, int64_t *ids, float *values) {
    for (int64_t j = 0; j < k; j++) ids[j] = -1, values[j] = -INFINITY;
    for (int64_t i = 0; i < n; i++) {
        const float v = logits[i];
        if (!(v > values[k - 1])) continue;
        int64_t j = k - 1;
        for (; j > 0 && v > values[j - 1]; j--) ids[j] = ids[j - 1], values[j] = values[j - 1];
        ids[j] = i, values[j] = v;
    }
    const float top = values[0];
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; i++) sum += fast_exp(logits[i] - top);
    return top + std::log(sum);
}
