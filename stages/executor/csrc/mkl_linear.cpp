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
//    twice), unless the caller found the one-row path to agree for this weight at the thread
//    count running now (`one_row_threads`, linear/mkl.py); that path is 8-15% faster.
// The symbols are looked up in the loaded libtorch_cpu at first use, so this library still
// loads on a torch without MKL (aarch64 wheels); mkl_linear_available() says which.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
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

// The packed buffer (bytes, so no dtype cast of a module touches it) opens with a header of
// kHeader bytes (so MKL's part stays as aligned as the tensor's 64 bytes): N and K, which a
// product checks against its own, and the address MKL packed at. MKL's packed matrices are
// not to be copied elsewhere; a moved one is refused rather than read.
constexpr int64_t kHeader = 64;
struct Header {
  int32_t n, k;
  uintptr_t packed_at;
};
static_assert(sizeof(Header) <= kHeader);

// float32 [N, K] -> the header, then MKL's packed B for y = x W^T (as many bytes as MKL asks).
at::Tensor mkl_pack(const at::Tensor& weight) {
  const Mkl* lib = mkl();
  TORCH_CHECK(lib != nullptr, "mkl_pack: this torch has no MKL (cblas_sgemm_pack)");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat,
              "mkl_pack: the weight must be float32 [N, K]");
  const at::Tensor w = weight.contiguous();
  const int n = checked_int(w.size(0), "N"), k = checked_int(w.size(1), "K");
  const size_t bytes = lib->get_size(kBMatrix, kPackRows, n, k);
  TORCH_CHECK(bytes >= static_cast<size_t>(n) * k * sizeof(float),
              "mkl_pack: MKL asks ", bytes, " bytes to pack ", n, " x ", k, " floats");
  // (MKL asks for more than it writes, up to 5x for small N; pages it never touches are
  // never made resident.)
  at::Tensor packed = at::empty({kHeader + static_cast<int64_t>(bytes)},
                                w.options().dtype(at::kByte));
  uint8_t* data = packed.data_ptr<uint8_t>();
  *reinterpret_cast<Header*>(data) = Header{n, k, reinterpret_cast<uintptr_t>(data + kHeader)};
  lib->pack(kRowMajor, kBMatrix, kTrans, kPackRows, n, k, 1.0f, w.data_ptr<float>(), k,
            reinterpret_cast<float*>(data + kHeader));
  return packed;
}

// x [M, K] float32 -> x W^T + b [M, N], W packed by mkl_pack. A lone row takes MKL's one-row
// path where `one_row_threads` is the thread count running now (the count at which the
// caller found that path to agree; 0: never), else runs as two (see the top of the file).
at::Tensor mkl_linear(const at::Tensor& x, const at::Tensor& packed,
                      const std::optional<at::Tensor>& bias, int64_t out_features,
                      int64_t one_row_threads) {
  const Mkl* lib = mkl();
  TORCH_CHECK(lib != nullptr, "mkl_linear: this torch has no MKL (cblas_sgemm_compute)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "mkl_linear: x must be contiguous float32 [M, K]");
  const int64_t rows = x.size(0);
  const int n = checked_int(out_features, "N"), k = checked_int(x.size(1), "K");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 1 &&
                  packed.numel() > kHeader && packed.is_contiguous(),
              "mkl_linear: the packed weight is not mkl_pack's");
  const uint8_t* data = packed.data_ptr<uint8_t>();
  const Header& header = *reinterpret_cast<const Header*>(data);
  TORCH_CHECK(header.n == n && header.k == k, "mkl_linear: the packed weight is ", header.n,
              " x ", header.k, ", not ", n, " x ", k);
  TORCH_CHECK(header.packed_at == reinterpret_cast<uintptr_t>(data + kHeader),
              "mkl_linear: the packed weight was copied or moved since mkl_pack made it "
              "(MKL's packed matrices stay where they were packed): pack it again");
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == n,
                "mkl_linear: the bias must be float32 [", n, "]");
  }
  if (rows == 0) return at::empty({0, n}, x.options());
  const bool doubled = rows == 1 && one_row_threads != at::get_num_threads();
  const at::Tensor a = doubled ? x.expand({2, k}).contiguous() : x;
  const int m = checked_int(a.size(0), "M");
  at::Tensor y = at::empty({m, n}, x.options());  // (C: the bias, which sgemm adds to)
  if (bias.has_value()) y.copy_(bias->view({1, n}).expand({m, n}));
  lib->compute(kRowMajor, kNoTrans, kPacked, m, n, k, a.data_ptr<float>(), k,
               reinterpret_cast<const float*>(data + kHeader), k,
               bias.has_value() ? 1.0f : 0.0f, y.data_ptr<float>(), n);
  return doubled ? y.narrow(0, 0, 1) : y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_cpu, m) {
  m.def("mkl_linear_available() -> bool", &mkl_linear_available);
  m.def("mkl_pack(Tensor weight) -> Tensor");
  m.def("mkl_linear(Tensor x, Tensor packed, Tensor? bias, int out_features, "
        "int one_row_threads=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(llm_cpu, CPU, m) {
  m.impl("mkl_pack", TORCH_FN(mkl_pack));
  m.impl("mkl_linear", TORCH_FN(mkl_linear));
}
