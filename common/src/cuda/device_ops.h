// cuda/device_ops.h: what the host code of library dp asks of a CUDA device (internal).
//
// tensor.cpp and tensor_ops.cpp dispatch on a view's device and call these functions for
// device memory. The header includes no CUDA header, so the rest of the library compiles
// with the host compiler alone. Two implementations exist, one per build:
//   - runtime.cpp (memory, copies) and kernels.cu (the kernels), when DP_CUDA is on;
//   - unavailable.cpp, when it is off: every function throws a dp::Error that says how to
//     configure a build with CUDA.
//
// Streams: every function works on the calling thread's current CUDA device and issues its
// work on the calling thread's compute stream, CUDA's per-thread default stream
// (cudaStreamPerThread): ranks are threads, so each rank has one compute stream of its own,
// and two ranks sharing a GPU run their kernels concurrently instead of queueing on the
// legacy default stream. Operations of one thread run in the order they are issued.
//
// How host reads synchronise: a function that returns a value computed on the device (dot,
// norm, all_finite, max_abs, the loss) or copies into host memory (copy_bytes) copies on the
// compute stream and waits for it (cudaStreamSynchronize), so the host sees every result
// issued before it. Everything else returns as soon as the work is queued. A device tensor
// handed to another thread (a rank's model returned to the main thread) must be
// synchronised by its thread first (`synchronize()`, or any host read); its memory is
// returned on the stream of the thread that frees it.
#pragma once

#include <cstddef>
#include <cstdint>

namespace dp::cuda {

/// Throws `dp::Error` naming `what` and the CUDA error unless `status` (a cudaError_t) is
/// cudaSuccess. Defined in runtime.cpp, so that kernels.cu needs no formatting library.
void check_status(int status, const char* what);

/// True when this build has CUDA (DP_CUDA on).
bool compiled();
/// Number of CUDA devices this process sees (0 without CUDA, a driver or a GPU).
int device_count();

/// The calling thread's compute stream, a cudaStream_t (opaque here: no CUDA header), for
/// code that orders other streams against it (events of a communicator).
void* compute_stream();
/// Waits until the work issued so far on the calling thread's compute stream has finished.
void synchronize();

/// `bytes` of device memory, uninitialised (nullptr for 0); throws `dp::Error` on failure.
void* allocate(std::size_t bytes);
/// Returns memory obtained from `allocate`.
void deallocate(void* block) noexcept;

/// Copies `bytes` from `source` to `destination`, either of which may be host or device
/// memory; returns when the destination holds the bytes (a host destination can be read).
void copy_bytes(void* destination, const void* source, std::size_t bytes);

/// The element types of tensors (dp::DataType's float32, bfloat16 and float16), as the
/// kernels name them; 16-bit elements are passed as their bit patterns.
enum class Element { kFloat32, kBFloat16, kFloat16 };

/// x[i] = value.
void fill(float* x, std::size_t n, float value);
/// x[i] = bits for n 16-bit elements: a bfloat16 or float16 tensor filled with one value,
/// rounded once by the caller.
void fill_bits16(std::uint16_t* x, std::size_t n, std::uint16_t bits);
/// x[i] = factor * x[i].
void scale(float* x, std::size_t n, float factor);
/// x[i] = x[i] / divisor.
void divide(float* x, std::size_t n, float divisor);
/// y[i] = y[i] + x[i].
void add(const float* x, float* y, std::size_t n);
/// y[i] = y[i] + (alpha * x[i]), the product rounded on its own.
void axpy(float alpha, const float* x, float* y, std::size_t n);
/// Sum of x[i] * y[i] in double precision (see kernels.cu for how it differs from the
/// host's index-order sum).
double dot(const float* x, const float* y, std::size_t n);
/// Sum of x[i]^2 in double precision (the square of the norm).
double sum_of_squares(const float* x, std::size_t n);
/// True when every x[i] is finite.
bool all_finite(const float* x, std::size_t n);
/// True when every x[i], a bfloat16 or float16 bit pattern (`type`), is finite.
bool all_finite_bits16(const std::uint16_t* x, Element type, std::size_t n);

/// y[i] = x[i] converted from `from` to `to` (different types), through float32 with the bit
/// arithmetic of dp/float16_bits.h: bitwise the host's dp::convert, NaN payloads included.
void convert(const void* x, Element from, void* y, Element to, std::size_t n);
/// y[i] = y[i] + x[i] with x of the 16-bit `type`, widened exactly (bitwise the host's).
void add_widened(const void* x, Element type, float* y, std::size_t n);
/// y[i] = y[i] + (alpha * x[i]) with x of the 16-bit `type`, widened exactly, the product
/// rounded on its own (bitwise the host's).
void axpy_widened(float alpha, const void* x, Element type, float* y, std::size_t n);
/// The largest |x[i]| (0 for n = 0); a NaN among them makes the result NaN. The maximum
/// does not depend on the order of the comparisons: it equals the host's bit for bit.
float max_abs(const float* x, std::size_t n);

/// How many arrays one launch of `fold_max_abs_bits` scans (its table is a kernel argument).
constexpr std::size_t kScanArraysPerLaunch = 64;
/// One pass over `count` device arrays (arrays[i] holds sizes[i] floats) for the largest |x|,
/// as the bits of a non-negative float: these order as unsigned integers, and 0x7f800000 or
/// more means some element is infinite or NaN. With `scan` (a device unsigned int, may be
/// nullptr) zeroed first, the result is folded into `*scan` and into `*running` (the same,
/// not zeroed: a maximum over several calls) with atomicMax, once per block after a
/// reduction in shared memory. One launch per kScanArraysPerLaunch arrays; returns once the
/// work is queued (read `*scan` with copy_bytes, which waits). The maximum does not depend on
/// the order of the comparisons: it equals the host's bit for bit.
void fold_max_abs_bits(const float* const* arrays, const std::size_t* sizes, std::size_t count,
                       unsigned int* scan, unsigned int* running);

// --- Matrix products (blas.cpp: cuBLAS) --------------------------------------------------

/// C = alpha * op(A) op(B) + beta * C on row-major device matrices, the contract of
/// dp::gemm (dp/ops.h): op(A) is (m, k), op(B) is (k, n), C is (m, n), and lda, ldb, ldc
/// are the row strides. Through cuBLAS with a pooled handle per thread and device (see
/// `set_cublas_handle_pooling`), in full float32 (no TF32).
void gemm(bool transpose_a, bool transpose_b, std::int64_t m, std::int64_t n, std::int64_t k,
          float alpha, const float* a, std::int64_t lda, const float* b, std::int64_t ldb,
          float beta, float* c, std::int64_t ldc);

/// Whether a thread gives its cuBLAS handles back to the process's pool when it ends (true,
/// the default: the next launch's ranks reuse them) or destroys them, as every rank thread
/// did before the pool (false: dp_gpu_step_time's baseline). Affects threads that end later.
void set_cublas_handle_pooling(bool pooled);
/// How many cuBLAS handles this process has made so far (0 without CUDA).
std::size_t cublas_handles_created();

// --- Layers (layer_kernels.cu): the loops of common/src/layers/*.cpp ---------------------
// Matrices are row-major (rows, cols); "+=" means the result is added into what is there.

/// out[r][j] = row[j] for every row r: the bias a Linear's output starts from.
void broadcast_rows(const float* row, float* out, std::int64_t rows, std::int64_t cols);
/// sums[j] += x[0][j] + x[1][j] + ...: the bias gradient of a Linear. The rows are added in 8
/// consecutive groups, each in row order, then the groups in order and the result into
/// sums[j] (layer_kernels.cu states it exactly): reproducible, within the float sum bound
/// of the host's row-order sum, not bitwise equal to it.
void add_column_sums(const float* x, std::int64_t rows, std::int64_t cols, float* sums);
/// y[i] = max(x[i], 0) (bitwise the host's).
void relu_forward(const float* x, float* y, std::size_t n);
/// dx[i] = x[i] > 0 ? dy[i] : 0 (bitwise the host's).
void relu_backward(const float* x, const float* dy, float* dx, std::size_t n);
/// The tanh approximation of GELU (dp/layers/gelu.h), within a few float ulps of the host.
void gelu_forward(const float* x, float* y, std::size_t n);
/// dx[i] = dy[i] * GELU'(x[i]), within a few float ulps of the host.
void gelu_backward(const float* x, const float* dy, float* dx, std::size_t n);
/// LayerNorm over rows of `width`: y = gamma * xhat + beta with xhat = (x - mean) * inv_std;
/// saves xhat (rows, width) and inv_std (rows). Row statistics in double, summed as a tree.
void layer_norm_forward(const float* x, const float* gamma, const float* beta, std::int64_t rows,
                        std::int64_t width, float eps, float* y, float* xhat, float* inv_std);
/// LayerNorm backward: dx (rows, width); dgamma += sum over rows of dy * xhat and dbeta +=
/// sum over rows of dy (each may be nullptr: a frozen parameter gets nothing), the sums in
/// the order of `add_column_sums`.
void layer_norm_backward(const float* dy, const float* xhat, const float* inv_std,
                         const float* gamma, std::int64_t rows, std::int64_t width, float* dx,
                         float* dgamma, float* dbeta);
/// Softmax cross-entropy forward on logits (rows, classes) and host `labels` (rows, checked
/// already): writes the probabilities (rows, classes) and returns the sum of the rows'
/// losses, added on the host in row order (double).
double cross_entropy_forward(const float* logits, const int* labels, std::int64_t rows,
                             std::int64_t classes, float* probabilities);
/// grad[r][j] = factor * (p[r][j] - (j == labels[r])), host `labels`.
void cross_entropy_backward(const float* probabilities, const int* labels, std::int64_t rows,
                            std::int64_t classes, float factor, float* grad);

/// The causal softmax of dp::CausalSelfAttention in place on `rows` consecutive rows of
/// `time` scores, row r being row i = r mod time of a (time, time) score matrix: entries
/// j <= i become exp(s_j - max) / sum (the maximum over j <= i, the sum in double as a tree,
/// then rounded once and multiplied), entries j > i become 0. Within a few float ulps of the
/// host loop (expf against std::exp, the sum's order).
void causal_softmax_forward(float* scores, std::int64_t rows, std::int64_t time);
/// Its backward in place: `grad` holds dP (rows, time) and becomes dS = P (dP - w) with
/// w = sum over j <= i of dP P (in double as a tree, rounded once) for j <= i, and 0 for
/// j > i. Within a few float ulps of the host loop.
void causal_softmax_backward(const float* probabilities, float* grad, std::int64_t rows,
                             std::int64_t time);
/// y[(b time + t) dim + c] = wte[ids[b time + t] dim + c] + wpe[t dim + c] (bitwise the host):
/// the ids (batch, time), device floats, are integers in [0, vocab) checked by the caller.
void embedding_forward(const float* ids, const float* wte, const float* wpe, std::int64_t batch,
                       std::int64_t time, std::int64_t dim, float* y);
/// dwte[v] += the sum of dy's rows at the positions of token v, in increasing position order
/// (given on the host as `positions`, (batch time) row indices grouped by token, token v's at
/// [offsets[v], offsets[v + 1]) of it, offsets (vocab + 1)); dwpe[t] += the sum over b, in
/// order, of dy's row b time + t. Each sum a float sum in that order, added once: bitwise the
/// host loop. Either gradient may be nullptr (frozen).
void embedding_backward(const float* dy, const std::int64_t* offsets, const std::int64_t* positions,
                        std::int64_t vocab, std::int64_t batch, std::int64_t time, std::int64_t dim,
                        float* dwte, float* dwpe);

/// SGD on n elements, the arithmetic of Sgd::update (dp/optimizer.h); `buffer` is the
/// momentum buffer at the same offset, nullptr without momentum.
void sgd_update(float* params, const float* grads, float* buffer, std::size_t n, float lr,
                float momentum, float weight_decay);

/// The per-step constants of AdamW (AdamW::update computes them on the host).
struct AdamWStep {
  float beta1, beta2, eps;  ///< the settings
  float step_size;          ///< lr / (1 - beta1^t)
  float sqrt_correction2;   ///< sqrt(1 - beta2^t)
  float decay;              ///< 1 - lr * weight_decay
};
/// AdamW on n elements, the arithmetic of AdamW::update; m and v at the same offset.
void adamw_update(float* params, const float* grads, float* m, float* v, std::size_t n,
                  const AdamWStep& step);

}  // namespace dp::cuda
