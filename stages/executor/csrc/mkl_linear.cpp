// float32 products on MKL's packed sgemm (cblas_sgemm_pack / cblas_sgemm_compute), the MKL
// that torch's x86 wheels carry inside libtorch_cpu: torch.ops.llm_cpu.mkl_pack and
// mkl_linear (stages/executor/linear/mkl.py says when they run and why).
//
// Two measured properties the callers rely on (tests/test_mkl.py checks both):
//  - The weight is packed once for kPackRows rows and then used for any number of rows; the
//    pack's size does not depend on that number, and results computed with it do not depend
//    on which other rows share the call (a row alone gives the bits it gives among 300), for
//    any thread count.
//  - Except one row alone: MKL takes another path for M = 1 whose sums round differently for
//    small N (here N <= 128 at 2 threads), so a single row is computed as two (the same row
//    twice), unless the caller says the one-row path agrees for this weight (`one_row`: the
//    caller checked, linear/mkl.py); that path streams the weights 8-15% faster.
// The symbols are looked up in the loaded libtorch_cpu at first use, so this library still
// loads on a torch without MKL (aarch64 wheels); mkl_linear_available() says which.

#include <ATen/ATen.h>
#include <dlfcn.h>
#include <torch/library.h>

#include <cstddef>
#include <cstdint>
#include <optional>

namespace {

// CBLAS's enum values (mkl_cblas.h).
enum { kRowMajor = 101, kNoTrans = 111, kTrans = 112, kPacked = 151, kBMatrix = 162 };
constexpr int kPackRows = 64;  // the M the B matrix is packed for (any M then uses it)

struct Mkl {
  size_t (*get_size)(int identifier, int m, int n, int k) = nullptr;
  void (*pack)(int layout, int identifier, int trans, int m, int n, int k, float alpha,
               const float* src, int ld, float* dest) = nullptr;
  void (*compute)(int layout, int transa, int transb, int m, int n, int k, const float* a,
                  int lda, const float* b, int ldb, float beta, float* c, int ldc) = nullptr;
};

const Mkl* mkl() {
  static const Mkl found = [] {
    Mkl m;
    // (libtorch_cpu is loaded already: this library links it)
    if (void* lib = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD)) {
      m.get_size = reinterpret_cast<decltype(m.get_size)>(
          dlsym(lib, "cblas_sgemm_pack_get_size"));
      m.pack = reinterpret_cast<decltype(m.pack)>(dlsym(lib, "cblas_sgemm_pack"));
      m.compute = reinterpret_cast<decltype(m.compute)>(dlsym(lib, "cblas_sgemm_compute"));
    }
    return m;
  }();
  return found.get_size && found.pack && found.compute ? &found : nullptr;
}

bool mkl_linear_available() { return mkl() != nullptr; }

int checked_int(int64_t v, const char* what) {
  TORCH_CHECK(v > 0 && v <= INT32_MAX, "mkl_linear: ", what, " ", v, " out of MKL's int range");
  return static_cast<int>(v);
}

// The packed buffer opens with a header of kHeader floats (64 bytes, so MKL's part stays as
// aligned as the tensor) whose first two hold N and K as int32: a product checks its shape.
constexpr int64_t kHeader = 16;

// float32 [N, K] -> the header, then MKL's packed B for y = x W^T (as many bytes as MKL asks).
at::Tensor mkl_pack(const at::Tensor& weight) {
  const Mkl* lib = mkl();
  TORCH_CHECK(lib != nullptr, "mkl_pack: this torch has no MKL (cblas_sgemm_pack)");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat,
              "mkl_pack: the weight must be float32 [N, K]");
  const at::Tensor w = weight.contiguous();
  const int n = checked_int(w.size(0), "N"), k = checked_int(w.size(1), "K");
  const size_t bytes = lib->get_size(kBMatrix, kPackRows, n, k);
  // (MKL asks for more than it writes, up to 5x for small N; pages it never touches are
  // never made resident.)
  at::Tensor packed = at::empty({kHeader + static_cast<int64_t>((bytes + 3) / 4)}, w.options());
  int32_t* header = reinterpret_cast<int32_t*>(packed.data_ptr<float>());
  header[0] = n;
  header[1] = k;
  lib->pack(kRowMajor, kBMatrix, kTrans, kPackRows, n, k, 1.0f, w.data_ptr<float>(), k,
            packed.data_ptr<float>() + kHeader);
  return packed;
}

// x [M, K] float32 -> x W^T + b [M, N], W packed by mkl_pack.
at::Tensor mkl_linear(const at::Tensor& x, const at::Tensor& packed,
                      const std::optional<at::Tensor>& bias, int64_t out_features,
                      bool one_row) {
  const Mkl* lib = mkl();
  TORCH_CHECK(lib != nullptr, "mkl_linear: this torch has no MKL (cblas_sgemm_compute)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "mkl_linear: x must be contiguous float32 [M, K]");
  const int64_t rows = x.size(0);
  const int n = checked_int(out_features, "N"), k = checked_int(x.size(1), "K");
  TORCH_CHECK(packed.scalar_type() == at::kFloat && packed.dim() == 1 &&
                  packed.numel() > kHeader && packed.is_contiguous(),
              "mkl_linear: the packed weight is not mkl_pack's");
  const int32_t* header = reinterpret_cast<const int32_t*>(packed.data_ptr<float>());
  TORCH_CHECK(header[0] == n && header[1] == k, "mkl_linear: the packed weight is ",
              header[0], " x ", header[1], ", not ", n, " x ", k);
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == n,
                "mkl_linear: the bias must be float32 [", n, "]");
  }
  if (rows == 0) return at::empty({0, n}, x.options());
  // One row alone goes as two unless its own path agrees (see the top of the file).
  const bool doubled = rows == 1 && !one_row;
  const at::Tensor a = doubled ? x.expand({2, k}).contiguous() : x;
  const int m = checked_int(a.size(0), "M");
  at::Tensor y = at::empty({m, n}, x.options());  // (C: the bias, which sgemm adds to)
  if (bias.has_value()) y.copy_(bias->view({1, n}).expand({m, n}));
  lib->compute(kRowMajor, kNoTrans, kPacked, m, n, k, a.data_ptr<float>(), k,
               packed.data_ptr<float>() + kHeader, k, bias.has_value() ? 1.0f : 0.0f,
               y.data_ptr<float>(), n);
  return doubled ? y.narrow(0, 0, 1) : y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_cpu, m) {
  m.def("mkl_linear_available() -> bool", &mkl_linear_available);
  m.def("mkl_pack(Tensor weight) -> Tensor");
  m.def("mkl_linear(Tensor x, Tensor packed, Tensor? bias, int out_features, "
        "bool one_row=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(llm_cpu, CPU, m) {
  m.impl("mkl_pack", TORCH_FN(mkl_pack));
  m.impl("mkl_linear", TORCH_FN(mkl_linear));
}
