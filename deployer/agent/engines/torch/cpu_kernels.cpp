// int4, int8 and fp32 weight linears for x86 CPUs with AVX2 and FMA: y = x @ W.T (see
// deployer/agent/engines/torch/native.py for why they exist and how they are built).
//
// fp32 weights stay as stored: each thread streams its rows one after the other, a dot product
// each, the input row in L1.
//
// The activations are quantized to int16 per 32 columns, so a block of 32 weights is two
// _mm256_madd_epi16 against them. The weights come repacked (native.pack_int4,
// native.pack_int8) into one stream per group of ROWS output rows: for each 32-column block, the
// ROWS rows' weights (int4: 16 bytes of nibbles, low nibble the even column, then each row's
// (scale, scale * zero) as two floats; int8: 32 bytes, the scale is per row). One sequential
// stream per thread is what lets two cores reach DRAM bandwidth; a stream per row and another
// per scale array did not.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t ROWS = 4;
constexpr int64_t BLOCK = 32;
constexpr int64_t BLOCK_BYTES = ROWS * BLOCK / 2 + ROWS * 2 * sizeof(float);
constexpr int64_t BLOCK_BYTES_INT8 = ROWS * BLOCK;
// Activations are quantized to int16 (see quantize_row); pairs of products stay far inside int32.
constexpr float QMAX = 32767.f;

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Row m of x as int16 blocks (with `split`, the even columns of a block first, then the odd ones,
// to match the nibble order), each block's step and the sum of its dequantized values. int16, not
// int8 as ggml's Q8 blocks: SmolLM2's activations have outliers a hundred times the rest of their
// block, and int8 steps left those others a bit or two (int8 weights then lost "Paris").
void quantize_row(const float* x, int64_t blocks, bool split, int16_t* q, float* step, float* sum) {
  for (int64_t b = 0; b < blocks; ++b) {
    const float* v = x + b * BLOCK;
    float amax = 0.f;
    for (int j = 0; j < BLOCK; ++j) amax = std::max(amax, std::fabs(v[j]));
    const float inv = amax > 0.f ? QMAX / amax : 0.f;
    int16_t* out = q + b * BLOCK;
    int total = 0;
    for (int j = 0; j < BLOCK; ++j) {
      const int at = split ? (j % 2) * (BLOCK / 2) + j / 2 : j;
      out[at] = static_cast<int16_t>(std::lrintf(v[j] * inv));
      total += out[at];
    }
    step[b] = amax / QMAX;
    sum[b] = step[b] * static_cast<float>(total);
  }
}

// w . x of 32 int16 weights (two registers) and the block's 32 int16 activations, as 8 int32 lanes.
inline __m256i dot32(__m256i w_first, __m256i w_second, const int16_t* x) {
  const __m256i x_first = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i x_second = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + BLOCK / 2));
  return _mm256_add_epi32(_mm256_madd_epi16(w_first, x_first), _mm256_madd_epi16(w_second, x_second));
}

// ROWS outputs of one input row: sum over blocks of scale * step * (q . xq) - scale * zero * sum.
void dot_rows_int4(const uint8_t* group, int64_t blocks, const int16_t* q, const float* step,
                   const float* sum, float* out) {
  const __m128i low4 = _mm_set1_epi8(0x0F);
  __m256 acc[ROWS];
  for (auto& a : acc) a = _mm256_setzero_ps();
  __m128 zero_terms = _mm_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = group + b * BLOCK_BYTES;
    _mm_prefetch(reinterpret_cast<const char*>(block + 8 * BLOCK_BYTES), _MM_HINT_T0);
    // (scale, scale * zero) of the four rows, times (step, sum) of this block.
    const __m256 factors = _mm256_mul_ps(
        _mm256_loadu_ps(reinterpret_cast<const float*>(block + ROWS * BLOCK / 2)),
        _mm256_set_ps(sum[b], step[b], sum[b], step[b], sum[b], step[b], sum[b], step[b]));
    alignas(32) float f[8];
    _mm256_store_ps(f, factors);
    for (int64_t r = 0; r < ROWS; ++r) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + r * BLOCK / 2));
      const __m256i even = _mm256_cvtepu8_epi16(_mm_and_si128(raw, low4));
      const __m256i odd = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), low4));
      const __m256i dot = dot32(even, odd, q + b * BLOCK);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(f[2 * r]), acc[r]);
    }
    zero_terms = _mm_add_ps(zero_terms, _mm_set_ps(f[7], f[5], f[3], f[1]));
  }
  alignas(16) float z[4];
  _mm_store_ps(z, zero_terms);
  for (int64_t r = 0; r < ROWS; ++r) out[r] = hsum(acc[r]) - z[r];
}

// ROWS outputs of one input row of int8 weights (scaled per row afterwards): sum over blocks of
// step * (w . xq).
void dot_rows_int8(const uint8_t* group, int64_t blocks, const int16_t* q, const float* step,
                   const float* /*sum*/, float* out) {
  __m256 acc[ROWS];
  for (auto& a : acc) a = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = group + b * BLOCK_BYTES_INT8;
    _mm_prefetch(reinterpret_cast<const char*>(block + 8 * BLOCK_BYTES_INT8), _MM_HINT_T0);
    const __m256 d = _mm256_set1_ps(step[b]);
    for (int64_t r = 0; r < ROWS; ++r) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + r * BLOCK));
      const __m256i first = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(w));
      const __m256i second = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(w, 1));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32(first, second, q + b * BLOCK)), d, acc[r]);
    }
  }
  for (int64_t r = 0; r < ROWS; ++r) out[r] = hsum(acc[r]);
}

using DotRows = void (*)(const uint8_t*, int64_t, const int16_t*, const float*, const float*, float*);

// y [m_rows, n] from x and weights packed `block_bytes` per ROWS rows and 32 columns.
template <typename T>
void store_rows(const float* out, T* y) {
  for (int64_t r = 0; r < ROWS; ++r) y[r] = static_cast<T>(out[r]);  // BFloat16: nearest even
}

// y [m_rows, n] in x's dtype (float32 or bfloat16, as torch's int4/int8 CPU kernels: a compiled
// graph then rounds where eager code does) from x and weights packed `block_bytes` per ROWS rows
// and 32 columns; `row_scale` (n floats, or null) multiplies each output column.
at::Tensor weight_only_linear(const char* name, const at::Tensor& x, const at::Tensor& packed, int64_t n,
                              int64_t block_bytes, bool split, DotRows dot, const float* row_scale) {
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x.dim() == 2 && (bf16 || x.scalar_type() == at::kFloat) && x.is_contiguous(),
              name, ": x must be a contiguous 2-D float32 or bfloat16 tensor");
  const int64_t m_rows = x.size(0), k = x.size(1), blocks = k / BLOCK;
  TORCH_CHECK(k % BLOCK == 0, name, ": in_features ", k, " is not a multiple of ", BLOCK);
  TORCH_CHECK(n % ROWS == 0, name, ": out_features ", n, " is not a multiple of ", ROWS);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.numel() == n / ROWS * blocks * block_bytes,
              name, ": packed weights do not match x and n (repack them with native.py)");
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  std::vector<int16_t> q(m_rows * k);
  std::vector<float> step(m_rows * blocks), sum(m_rows * blocks), row(k);
  for (int64_t m = 0; m < m_rows; ++m) {
    const float* values = row.data();
    if (bf16) {
      const c10::BFloat16* from = x.data_ptr<c10::BFloat16>() + m * k;
      std::transform(from, from + k, row.begin(), [](c10::BFloat16 v) { return static_cast<float>(v); });
    } else {
      values = x.data_ptr<float>() + m * k;
    }
    quantize_row(values, blocks, split, q.data() + m * k, step.data() + m * blocks, sum.data() + m * blocks);
  }
  at::Tensor y = at::empty({m_rows, n}, x.options());
  // Row groups split between the threads; each group's blocks stay in L1 across the input rows.
  at::parallel_for(0, n / ROWS, 4, [&](int64_t first, int64_t last) {
    alignas(16) float out[ROWS];
    for (int64_t g = first; g < last; ++g) {
      const uint8_t* group = wp + g * blocks * block_bytes;
      for (int64_t m = 0; m < m_rows; ++m) {
        dot(group, blocks, q.data() + m * k, step.data() + m * blocks, sum.data() + m * blocks, out);
        if (row_scale != nullptr) {
          for (int64_t r = 0; r < ROWS; ++r) out[r] *= row_scale[g * ROWS + r];
        }
        if (bf16) {
          store_rows(out, y.data_ptr<c10::BFloat16>() + m * n + g * ROWS);
        } else {
          store_rows(out, y.data_ptr<float>() + m * n + g * ROWS);
        }
      }
    }
  });
  return y;
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  return weight_only_linear("int4_linear", x, packed, n, BLOCK_BYTES, true, dot_rows_int4, nullptr);
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, int64_t n) {
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == n,
              "int8_linear: scale must be n contiguous float32 values");
  return weight_only_linear("int8_linear", x, packed, n, BLOCK_BYTES_INT8, false, dot_rows_int8,
                            scale.data_ptr<float>());
}

// y [m_rows, n] = x @ w.T for fp32 x [m_rows, k] and w [n, k], k a multiple of 32.
at::Tensor fp32_linear(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "fp32_linear: x must be a contiguous 2-D float32 tensor");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous() && w.size(1) == x.size(1),
              "fp32_linear: w must be a contiguous float32 [n, k] tensor with x's k");
  const int64_t m_rows = x.size(0), k = x.size(1), n = w.size(0);
  TORCH_CHECK(k % BLOCK == 0, "fp32_linear: in_features ", k, " is not a multiple of ", BLOCK);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  at::Tensor y = at::empty({m_rows, n}, x.options());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t first, int64_t last) {
    for (int64_t row = first; row < last; ++row) {
      const float* weights = wp + row * k;
      for (int64_t m = 0; m < m_rows; ++m) {
        const float* in = xp + m * k;
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t c = 0; c < k; c += BLOCK) {
          _mm_prefetch(reinterpret_cast<const char*>(weights + c + 256), _MM_HINT_T0);
          for (int j = 0; j < 4; ++j) {
            acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(weights + c + 8 * j), _mm256_loadu_ps(in + c + 8 * j), acc[j]);
          }
        }
        yp[m * n + row] = hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(sits, m) {
  m.def("int4_linear(Tensor x, Tensor packed, int n) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor packed, Tensor scale, int n) -> Tensor");
  m.def("fp32_linear(Tensor x, Tensor w) -> Tensor");
}
TORCH_LIBRARY_IMPL(sits, CPU, m) {
  m.impl("int4_linear", int4_linear);
  m.impl("int8_linear", int8_linear);
  m.impl("fp32_linear", fp32_linear);
}
