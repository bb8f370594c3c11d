// y = x @ w^T (+ bias) for the few rows of a decode or verification step, bf16 in and out, fp32 accumulation.
//
// Built into the same extension as paged_attention.cpp (modeling/attention/cpu_kernel.py); used by
// modeling/cpu_linear.py for bf16 linear layers when a step has at most a few rows. A decode step reads
// every weight once for a handful of rows: it is a stream over the weights, bound by memory bandwidth.
// torch's bf16 GEMM for M = 1..16 rows reads them at a quarter to a third of the bandwidth a plain
// reduction reaches on the AVX512-BF16 EPYC this was written on; this loop gets 2-3x more.
//
// Shapes: x [M, K] bf16 (rows contiguous), w [N, K] bf16 contiguous (nn.Linear's layout), bias [N] bf16
// or absent; y [M, N] bf16. K % 32 == 0.
//
// Each output column n is one weight row streamed once, front to back, for up to 4 input rows at a time:
// 4 independent accumulator chains per input row (VDPBF16PS on 32 bf16 pairs, 128 weights a step), summed
// at the end of the row. Every output element is computed by the same operations in the same order
// whatever M is, so a row of a verification step equals the decode step of that token bit for bit.
// Columns are split over torch's threads (at::parallel_for, contiguous ranges: one stream per thread).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512BF16__)
template <int MR>
void columns(const uint16_t* x, int64_t x_stride, const uint16_t* w, int64_t K, const c10::BFloat16* bias,
             int64_t n0, int64_t n1, c10::BFloat16* y, int64_t N) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* wr = w + n * K;
    __m512 acc[4][MR];
    for (int j = 0; j < 4; ++j)
      for (int m = 0; m < MR; ++m) acc[j][m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 128 <= K; k += 128)
      for (int j = 0; j < 4; ++j) {
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(wr + k + 32 * j);
        for (int m = 0; m < MR; ++m)
          acc[j][m] = _mm512_dpbf16_ps(acc[j][m], wv, (__m512bh)_mm512_loadu_si512(x + m * x_stride + k + 32 * j));
      }
    for (; k < K; k += 32) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(wr + k);
      for (int m = 0; m < MR; ++m)
        acc[0][m] = _mm512_dpbf16_ps(acc[0][m], wv, (__m512bh)_mm512_loadu_si512(x + m * x_stride + k));
    }
    const float b = bias ? static_cast<float>(bias[n]) : 0.f;
    for (int m = 0; m < MR; ++m) {
      const __m512 s = _mm512_add_ps(_mm512_add_ps(acc[0][m], acc[1][m]), _mm512_add_ps(acc[2][m], acc[3][m]));
      y[m * N + n] = c10::BFloat16(_mm512_reduce_add_ps(s) + b);  // round to nearest even
    }
  }
}
#endif

}  // namespace

bool skinny_linear_supported() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(skinny_linear_supported(), "skinny_linear: this build has no AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "skinny_linear: x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "skinny_linear: bf16 only");
  TORCH_CHECK(x.size(1) % 32 == 0, "skinny_linear: K must be a multiple of 32");
  TORCH_CHECK(x.stride(1) == 1 && w.is_contiguous(), "skinny_linear: rows of x and w must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const c10::BFloat16* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == N,
                "skinny_linear: bias must be bf16 [N]");
    b = bias->data_ptr<c10::BFloat16>();
  }
  auto y = torch::empty({M, N}, x.options());
#if defined(__AVX512BF16__)
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  auto* yp = y.data_ptr<c10::BFloat16>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) columns<4>(xp + m * xs, xs, wp, K, b, n0, n1, yp + m * N, N);
    switch (M - m) {
      case 1: columns<1>(xp + m * xs, xs, wp, K, b, n0, n1, yp + m * N, N); break;
      case 2: columns<2>(xp + m * xs, xs, wp, K, b, n0, n1, yp + m * N, N); break;
      case 3: columns<3>(xp + m * xs, xs, wp, K, b, n0, n1, yp + m * N, N); break;
      default: break;
    }
  });
#endif
  return y;
}
