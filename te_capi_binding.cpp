// pybind11 binding of Transformer Engine's fused RoPE C API (transformer_engine/fused_rope.h),
// compiled by te_comparator.py at first use against the library under $TE_HOME.

#include <cstdint>
#include <stdexcept>
#include <vector>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <transformer_engine/fused_rope.h>

namespace {

using Desc = std::vector<int64_t>;  // {data_ptr, NVTEDType, dims...}; data_ptr 0 = absent

// A non-owning NVTETensor over memory that a torch tensor owns, destroyed at scope exit.
// An absent optional input (cu_seqlens, start_positions) is an NVTETensor with no data set,
// i.e. a null data pointer, which is what TE's kernels test for.
class TensorView {
 public:
  explicit TensorView(const Desc &desc) {
    constexpr size_t max_ndim = sizeof(NVTEShape::data) / sizeof(size_t);
    if (desc.size() < 2 || desc.size() - 2 > max_ndim) {
      throw std::invalid_argument("tensor descriptor must be {data_ptr, dtype, dims...}");
    }
    handle_ = nvte_create_tensor(NVTE_DELAYED_TENSOR_SCALING);
    if (desc[0] == 0) return;
    NVTEBasicTensor data{};
    data.data_ptr = reinterpret_cast<void *>(static_cast<intptr_t>(desc[0]));
    data.dtype = static_cast<NVTEDType>(desc[1]);
    data.shape.ndim = desc.size() - 2;
    for (size_t i = 0; i < data.shape.ndim; ++i) data.shape.data[i] = desc[i + 2];
    nvte_set_tensor_param_v2(handle_, kNVTERowwiseData, &data, sizeof(data));
  }
  ~TensorView() { nvte_destroy_tensor(handle_); }
  TensorView(const TensorView &) = delete;
  TensorView &operator=(const TensorView &) = delete;
  NVTETensor get() const { return handle_; }

 private:
  NVTETensor handle_;
};

cudaStream_t to_stream(int64_t stream) {
  return reinterpret_cast<cudaStream_t>(static_cast<intptr_t>(stream));
}

// nvte_fused_rope_forward and _backward take the same arguments; for backward read
// input/output as grad_output/grad_input.
void rope(bool backward, const Desc &input, const Desc &cu_seqlens, const Desc &freqs,
          const Desc &start_positions, const Desc &output, int qkv_format, bool interleaved,
          int cp_size, int cp_rank, int s, int b, int h, int d, int d2, int stride_s_or_t,
          int stride_b, int stride_h, int stride_d, int64_t stream) {
  TensorView in(input), cu(cu_seqlens), fr(freqs), start(start_positions), out(output);
  auto *fn = backward ? nvte_fused_rope_backward : nvte_fused_rope_forward;
  fn(in.get(), cu.get(), fr.get(), start.get(), out.get(),
     static_cast<NVTE_QKV_Format>(qkv_format), interleaved, cp_size, cp_rank, s, b, h, d, d2,
     stride_s_or_t, stride_b, stride_h, stride_d, to_stream(stream));
}

void qkv_rope_forward(const Desc &qkv, const Desc &q_freqs, const Desc &k_freqs,
                      const Desc &start_positions, const Desc &q_out, const Desc &k_out,
                      const Desc &v_out, int qkv_format, bool interleaved, int cp_size,
                      int cp_rank, int s, int b, int h, int d, int d2, int split_q, int split_k,
                      int split_v, int64_t stream) {
  TensorView in(qkv), qf(q_freqs), kf(k_freqs), start(start_positions);
  TensorView q(q_out), k(k_out), v(v_out);
  nvte_fused_qkv_rope_forward(in.get(), qf.get(), kf.get(), start.get(), q.get(), k.get(),
                              v.get(), static_cast<NVTE_QKV_Format>(qkv_format), interleaved,
                              cp_size, cp_rank, s, b, h, d, d2, split_q, split_k, split_v,
                              to_stream(stream));
}

void qkv_rope_backward(const Desc &q_grad, const Desc &k_grad, const Desc &v_grad,
                       const Desc &q_freqs, const Desc &k_freqs, const Desc &qkv_grad,
                       int qkv_format, bool interleaved, int cp_size, int cp_rank, int s, int b,
                       int h, int d, int d2, int split_q, int split_k, int split_v,
                       int64_t stream) {
  TensorView gq(q_grad), gk(k_grad), gv(v_grad), qf(q_freqs), kf(k_freqs), out(qkv_grad);
  nvte_fused_qkv_rope_backward(gq.get(), gk.get(), gv.get(), qf.get(), kf.get(), out.get(),
                               static_cast<NVTE_QKV_Format>(qkv_format), interleaved, cp_size,
                               cp_rank, s, b, h, d, d2, split_q, split_k, split_v,
                               to_stream(stream));
}

}  // namespace

// TE's NVTE_CHECK failures are C++ exceptions; pybind11 turns them into Python RuntimeErrors.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rope", &rope);
  m.def("qkv_rope_forward", &qkv_rope_forward);
  m.def("qkv_rope_backward", &qkv_rope_backward);
}
