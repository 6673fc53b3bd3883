// CPU kernels of the engine, built on first use by cpu_kernels.py (g++ -O3 -march=native) and
// registered as torch ops under pdfleet::. Plain C++ that the compiler vectorizes; no intrinsics.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <sched.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// 16 floats: GCC's generic vectors, lowered to whatever the target has (one zmm, two ymm, ...).
typedef float v16f __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef int8_t v16b __attribute__((vector_size(16)));
constexpr int64_t L = 16;

inline v16f load16(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline v16f load16(const c10::BFloat16* p) {  // bf16 is the top half of an fp32
  v16h h;
  std::memcpy(&h, p, sizeof h);
  v16u u = __builtin_convertvector(h, v16u) << 16;
  v16f v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}
inline v16f load16(const int8_t* p) {
  v16b b;
  std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(b, v16f);
}

inline float hsum(v16f v) {  // a tree, not 16 dependent adds
  typedef float v8f __attribute__((vector_size(32)));
  typedef float v4f __attribute__((vector_size(16)));
  v8f a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  v4f b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// Blocks sit anywhere in the pool, so the hardware prefetcher loses the stream at every block
// boundary: while one block is read, the same row of the next one is requested.
template <typename KV>
inline void prefetch_row(const KV* row, int64_t D) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t off = 0; off < D * static_cast<int64_t>(sizeof(KV)); off += 64) __builtin_prefetch(p + off, 0, 3);
}

// exp(x) for x <= 0 (Cephes expf: range reduction by ln 2 in two parts, degree-5 polynomial,
// about 1 ulp); written so that the loop calling it vectorizes.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// One (sequence, KV head): the G query heads of the group against the sequence's context, read
// once through its block table. Two passes over the context: scores (K), then values (V).
// q: [G, DV] vectors, already scaled; acc: [G, DV] vectors. DV = D / 16 (NDV > 0: known at compile time).
template <int NDV, typename KV>
void decode_one(const v16f* q, int64_t G, int64_t DV_rt, const KV* k_head, const KV* v_head, const float* k_scale,
                const float* v_scale, const int64_t* table, int64_t ctx, int64_t block_size, float* scores, v16f* acc) {
  const int64_t DV = NDV > 0 ? NDV : DV_rt;
  const int64_t D = DV * L;
  const int64_t block_elems = block_size * D;
  for (int64_t t0 = 0, j = 0; t0 < ctx; t0 += block_size, ++j) {
    const int64_t n = std::min(block_size, ctx - t0);
    const int64_t blk = table[j];
    const KV* k = k_head + blk * block_elems;
    const KV* next = t0 + block_size < ctx ? k_head + table[j + 1] * block_elems : k;
    const float ks = k_scale ? k_scale[blk] : 1.0f;
    for (int64_t t = 0; t < n; ++t) {
      const KV* row = k + t * D;
      prefetch_row(next + t * D, D);
      v16f kr[NDV > 0 ? NDV : 16];
      if (NDV > 0 || DV <= 16) {
        for (int64_t c = 0; c < DV; ++c) kr[c] = load16(row + c * L);
        for (int64_t g = 0; g < G; ++g) {
          v16f s = q[g * DV] * kr[0];
          for (int64_t c = 1; c < DV; ++c) s += q[g * DV + c] * kr[c];
          scores[g * ctx + t0 + t] = hsum(s) * ks;
        }
      } else {
        for (int64_t g = 0; g < G; ++g) {
          v16f s = q[g * DV] * load16(row);
          for (int64_t c = 1; c < DV; ++c) s += q[g * DV + c] * load16(row + c * L);
          scores[g * ctx + t0 + t] = hsum(s) * ks;
        }
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores + g * ctx;
    float m = -INFINITY;
    for (int64_t t = 0; t < ctx; ++t) m = std::max(m, s[t]);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < ctx; ++t) {
      s[t] = exp_nonpositive(s[t] - m);
      sum += s[t];
    }
    const float inv = 1.0f / sum;
#pragma omp simd
    for (int64_t t = 0; t < ctx; ++t) s[t] *= inv;
  }
  for (int64_t i = 0; i < G * DV; ++i) acc[i] = v16f{};
  for (int64_t t0 = 0, j = 0; t0 < ctx; t0 += block_size, ++j) {
    const int64_t n = std::min(block_size, ctx - t0);
    const int64_t blk = table[j];
    const KV* v = v_head + blk * block_elems;
    const KV* next = t0 + block_size < ctx ? v_head + table[j + 1] * block_elems : v;
    const float vs = v_scale ? v_scale[blk] : 1.0f;
    for (int64_t t = 0; t < n; ++t) {
      const KV* row = v + t * D;
      prefetch_row(next + t * D, D);
      for (int64_t c = 0; c < DV; ++c) {
        const v16f vr = load16(row + c * L);
        for (int64_t g = 0; g < G; ++g) acc[g * DV + c] += (scores[g * ctx + t0 + t] * vs) * vr;
      }
    }
  }
}

template <typename Out>
inline float scalar(Out x) { return static_cast<float>(x); }

template <typename KV, typename Out>
void decode_all(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv, const c10::optional<at::Tensor>& scale,
                const at::Tensor& tables, const at::Tensor& lens, double softmax_scale) {
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t Hkv = kv.size(1), NB = kv.size(2), BS = kv.size(3), W = tables.size(1);
  const int64_t G = Hq / Hkv, DV = D / L;
  const KV* kv_ptr = kv.data_ptr<KV>();
  const float* scale_ptr = scale ? scale->data_ptr<float>() : nullptr;
  const int64_t* table_ptr = tables.data_ptr<int64_t>();
  const int64_t* len_ptr = lens.data_ptr<int64_t>();
  Out* out_ptr = out.data_ptr<Out>();
  const Out* q_ptr = q.data_ptr<Out>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  const float fscale = static_cast<float>(softmax_scale);
  // A small step (a lone decode over a short context) stays on the calling thread: an OpenMP
  // region costs more than it saves there, and far more when another process holds a core.
  int64_t work = 0;
  for (int64_t b = 0; b < B; ++b) work += len_ptr[b];
  const int64_t grain = work * Hkv < 8192 ? B * Hkv : 1;
  at::parallel_for(0, B * Hkv, grain, [&](int64_t begin, int64_t end) {
    std::vector<v16f> qv(G * DV), acc(G * DV);
    std::vector<float> scores;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / Hkv, h = i % Hkv;
      float* qf = reinterpret_cast<float*>(qv.data());
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = scalar(q_ptr[b * qs0 + (h * G + g) * qs1 + d]) * fscale;
      const KV* k_head = kv_ptr + (0 * Hkv + h) * NB * BS * D;
      const KV* v_head = kv_ptr + (1 * Hkv + h) * NB * BS * D;
      const float* ks = scale_ptr ? scale_ptr + (0 * Hkv + h) * NB : nullptr;
      const float* vs = scale_ptr ? scale_ptr + (1 * Hkv + h) * NB : nullptr;
      const int64_t ctx = len_ptr[b];
      scores.resize(G * ctx);
      const int64_t* table = table_ptr + b * W;
      if (DV == 4)
        decode_one<4, KV>(qv.data(), G, DV, k_head, v_head, ks, vs, table, ctx, BS, scores.data(), acc.data());
      else if (DV == 8)
        decode_one<8, KV>(qv.data(), G, DV, k_head, v_head, ks, vs, table, ctx, BS, scores.data(), acc.data());
      else
        decode_one<0, KV>(qv.data(), G, DV, k_head, v_head, ks, vs, table, ctx, BS, scores.data(), acc.data());
      const float* a = reinterpret_cast<const float*>(acc.data());
      Out* o = out_ptr + b * os0 + h * G * os1;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) o[g * os1 + d] = static_cast<Out>(a[g * D + d]);
    }
  });
}

// out[b, hq, :] = softmax(q[b, hq] . K[ctx_b]^T * scale) V[ctx_b], reading the pool through the
// block table. q, out: [B, Hq, D] (last dim contiguous); kv: [2, Hkv, NB, BS, D] contiguous (float,
// bf16 or int8 with scale [2, Hkv, NB]); tables: [B, W] int64; lens: [B] int64, 1 <= lens[b] <= W * BS.
void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& kv,
                            const c10::optional<at::Tensor>& scale, const at::Tensor& tables,
                            const at::Tensor& lens, double softmax_scale) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q and out must be [B, Hq, D] of the same shape");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "q and out need a contiguous last dimension");
  TORCH_CHECK(kv.dim() == 5 && kv.size(0) == 2 && kv.size(4) == q.size(2) && kv.is_contiguous(),
              "kv must be a contiguous [2, Hkv, NB, BS, D] pool");
  TORCH_CHECK(q.size(1) % kv.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(q.size(2) % L == 0, "head_dim must be a multiple of 16");
  TORCH_CHECK(tables.scalar_type() == at::kLong && lens.scalar_type() == at::kLong && tables.is_contiguous() &&
                  lens.is_contiguous() && tables.size(0) == q.size(0) && lens.size(0) == q.size(0),
              "tables [B, W] and lens [B] must be contiguous int64");
  TORCH_CHECK(out.scalar_type() == q.scalar_type(), "out and q must share a dtype");
  const bool quantized = kv.scalar_type() == at::kChar;
  TORCH_CHECK(quantized == scale.has_value(), "an int8 pool needs its scales, a float pool none");
  TORCH_CHECK(!quantized || (scale->scalar_type() == at::kFloat && scale->is_contiguous()), "scale must be float32");
  TORCH_CHECK(quantized || kv.scalar_type() == q.scalar_type(), "a float pool must have q's dtype");
  const int64_t cap = tables.size(1) * kv.size(3);
  const int64_t* len_ptr = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < lens.size(0); ++b)
    TORCH_CHECK(len_ptr[b] >= 1 && len_ptr[b] <= cap, "context length ", len_ptr[b], " outside [1, ", cap, "]");
  if (q.scalar_type() == at::kFloat) {
    if (quantized) decode_all<int8_t, float>(out, q, kv, scale, tables, lens, softmax_scale);
    else decode_all<float, float>(out, q, kv, scale, tables, lens, softmax_scale);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "q must be float32 or bfloat16");
    if (quantized) decode_all<int8_t, c10::BFloat16>(out, q, kv, scale, tables, lens, softmax_scale);
    else decode_all<c10::BFloat16, c10::BFloat16>(out, q, kv, scale, tables, lens, softmax_scale);
  }
}

// Bind compute thread i (ATen's OpenMP pool) to cores[i % len], or with exclusive=false every
// thread to all of cores (undoing a binding). Returns how many threads took the new affinity.
int64_t pin_threads(const std::vector<int64_t>& cores, bool exclusive) {
  TORCH_CHECK(!cores.empty(), "no cores to pin to");
  const int64_t n = at::get_num_threads();
  std::vector<int> ok(n, 0);
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t tid = at::get_thread_num();
      cpu_set_t set;
      CPU_ZERO(&set);
      if (exclusive) {
        CPU_SET(static_cast<int>(cores[tid % cores.size()]), &set);
      } else {
        for (int64_t c : cores) CPU_SET(static_cast<int>(c), &set);
      }
      ok[tid] = sched_setaffinity(0, sizeof set, &set) == 0;
    }
  });
  int64_t pinned = 0;
  for (int v : ok) pinned += v;
  return pinned;
}


// -- small fused ops of a decode step ---------------------------------------------------------
// At batch 1 a decode step is bandwidth-bound on the weights and every extra kernel costs several
// microseconds; these replace 2-4 PyTorch kernels each. (A SiLU-and-multiply was tried and
// dropped: GCC left its exp scalar, 10x slower than PyTorch's vectorized one at 64 rows.) Rows run in parallel only when there are
// enough of them (a lone decode's row runs on the calling thread, with no OpenMP barrier).
constexpr int64_t ROWS_PER_TASK = 8;

template <typename T>
inline float ld(const T* p) { return static_cast<float>(*p); }

// y = weight * norm(x + delta) with h = x + delta stored back into x (the residual stream), as
// Hugging Face computes it: the sum in the stream's dtype, the norm in fp32, cast back, then weight.
template <typename T>
void add_rms_norm_rows(T* x, const T* delta, const T* w, T* y, int64_t rows, int64_t n, int64_t sx, int64_t sd,
                       int64_t sy, float eps) {
  at::parallel_for(0, rows, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(n);
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * sx;
      float ss = 0.0f;
      for (int64_t i = 0; i < n; ++i) {
        float v = ld(xr + i);
        if (delta) {
          const T h = static_cast<T>(v + ld(delta + r * sd + i));  // rounded to the stream's dtype
          xr[i] = h;
          v = static_cast<float>(h);
        }
        buf[i] = v;
        ss += v * v;
      }
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
      T* yr = y + r * sy;
      for (int64_t i = 0; i < n; ++i) yr[i] = static_cast<T>(ld(w + i) * static_cast<float>(static_cast<T>(buf[i] * inv)));
    }
  });
}

// Returns norm(x) (delta undefined) or norm(x + delta) after x += delta in place. x, delta: [T, N]
// rows with a contiguous last dim; weight: [N].
at::Tensor add_rms_norm(at::Tensor x, const c10::optional<at::Tensor>& delta, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && weight.is_contiguous() && weight.size(0) == x.size(1),
              "x must be [T, N] with a contiguous last dim and weight [N]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight and x must share a dtype");
  if (delta) TORCH_CHECK(delta->sizes() == x.sizes() && delta->stride(1) == 1 && delta->scalar_type() == x.scalar_type(),
                         "delta must be like x");
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t rows = x.size(0), n = x.size(1);
  if (x.scalar_type() == at::kFloat) {
    add_rms_norm_rows<float>(x.data_ptr<float>(), delta ? delta->data_ptr<float>() : nullptr, weight.data_ptr<float>(),
                             y.data_ptr<float>(), rows, n, x.stride(0), delta ? delta->stride(0) : 0, y.stride(0),
                             static_cast<float>(eps));
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
    using B = c10::BFloat16;
    add_rms_norm_rows<B>(x.data_ptr<B>(), delta ? delta->data_ptr<B>() : nullptr, weight.data_ptr<B>(), y.data_ptr<B>(),
                         rows, n, x.stride(0), delta ? delta->stride(0) : 0, y.stride(0), static_cast<float>(eps));
  }
  return y;
}

// Rotate heads[:, :n] in place: x * cos + roll(x, D/2) * signed_sin, the product in fp32 and
// rounded once, as torch.addcmul does. heads: [T, H, D] (head and last dims contiguous within a
// row); cos, sin: [T, D] contiguous.
template <typename T>
void rope_rows(T* x, const T* cos, const T* sin, int64_t rows, int64_t heads, int64_t d, int64_t sx) {
  const int64_t half = d / 2;
  at::parallel_for(0, rows, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
    std::vector<float> tmp(d);
    for (int64_t r = begin; r < end; ++r) {
      const T* c = cos + r * d;
      const T* s = sin + r * d;
      for (int64_t h = 0; h < heads; ++h) {
        T* xr = x + r * sx + h * d;
        for (int64_t i = 0; i < half; ++i)  // roll(x, D/2): the two halves swap
          tmp[i] = static_cast<float>(static_cast<T>(ld(xr + i) * ld(c + i))) + ld(xr + i + half) * ld(s + i);
        for (int64_t i = half; i < d; ++i)
          tmp[i] = static_cast<float>(static_cast<T>(ld(xr + i) * ld(c + i))) + ld(xr + i - half) * ld(s + i);
        for (int64_t i = 0; i < d; ++i) xr[i] = static_cast<T>(tmp[i]);
      }
    }
  });
}

void rope_(at::Tensor heads, int64_t n, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(heads.dim() == 3 && heads.stride(2) == 1 && heads.stride(1) == heads.size(2), "heads must be [T, H, D], rows of whole heads");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 && cos.size(0) == heads.size(0) &&
                  cos.size(1) == heads.size(2) && sin.sizes() == cos.sizes(), "cos and sin must be contiguous [T, D]");
  TORCH_CHECK(n >= 0 && n <= heads.size(1) && heads.size(2) % 2 == 0, "bad head count or odd head_dim");
  TORCH_CHECK(cos.scalar_type() == heads.scalar_type() && sin.scalar_type() == heads.scalar_type(), "dtypes differ");
  if (heads.scalar_type() == at::kFloat) {
    rope_rows<float>(heads.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), heads.size(0), n,
                     heads.size(2), heads.stride(0));
  } else {
    TORCH_CHECK(heads.scalar_type() == at::kBFloat16, "heads must be float32 or bfloat16");
    using B = c10::BFloat16;
    rope_rows<B>(heads.data_ptr<B>(), cos.data_ptr<B>(), sin.data_ptr<B>(), heads.size(0), n, heads.size(2),
                 heads.stride(0));
  }
}

// mkldnn::_linear_pointwise(x, packed, bias) with no post-op, under a name torch.compile treats as
// an opaque call (its own lowering of that op accepts only weights it packed itself).
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                                         c10::string_view, c10::List<c10::optional<c10::Scalar>>,
                                         c10::optional<c10::string_view>)>();
  return op.call(x, packed, bias, "none", c10::List<c10::optional<c10::Scalar>>(), "");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdfleet, m) {
  m.def("paged_decode_attention(Tensor(a!) out, Tensor q, Tensor kv, Tensor? scale, Tensor tables, Tensor lens, "
        "float softmax_scale) -> ()");
  m.def("pin_threads(int[] cores, bool exclusive=True) -> int", &pin_threads);
  m.def("onednn_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) x, Tensor? delta, Tensor weight, float eps) -> Tensor");
  m.def("rope_(Tensor(a!) heads, int n, Tensor cos, Tensor sin) -> ()");
}

TORCH_LIBRARY_IMPL(pdfleet, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("onednn_linear", &onednn_linear);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope_", &rope_);
}

// The packed weight is an MKLDNN tensor, which dispatches on its own key.
TORCH_LIBRARY_IMPL(pdfleet, MkldnnCPU, m) { m.impl("onednn_linear", &onednn_linear); }
