// FlashInfer's rotary embedding from positions and a cos / sin cache, in place, behind an extern "C"
// entry point: the peer of the qk_rope sub-command (loaded with ctypes). flashinfer.py prepares the
// headers and builds it:
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -shared -Xcompiler -fPIC -I.flashinfer/include \
//        cupy_rmsnorm/bench/flashinfer_rope.cu -o .flashinfer/libfirope.so
//
// The call is the one FlashInfer's apply_rope_with_cos_sin_cache_inplace makes (csrc/rope.cu):
// q_rope = q and k_rope = k, strides in elements, int64 positions, a float32 cache of
// (max_position, rotary_dim), cos in its first rotary_dim / 2 columns and sin in the others.
#include <flashinfer/pos_enc.cuh>

#include <cstdint>
#include <exception>
#include <string>

namespace {
std::string last_error;  // what the last call threw (FlashInfer reports bad arguments by exceptions)

template <typename T>
int apply_in_place(void* q, void* k, float* cos_sin_cache, int64_t* positions, unsigned tokens, unsigned q_heads,
                   unsigned k_heads, unsigned rotary_dim, unsigned head_dim, size_t q_stride_token,
                   size_t q_stride_head, size_t k_stride_token, size_t k_stride_head, bool interleave,
                   cudaStream_t stream) {
    T* qt = static_cast<T*>(q);
    T* kt = static_cast<T*>(k);
    return static_cast<int>(flashinfer::BatchQKApplyRotaryPosIdsCosSinCache<T, int64_t>(
        qt, kt, qt, kt, cos_sin_cache, positions, tokens, q_heads, k_heads, rotary_dim, head_dim, q_stride_token,
        q_stride_head, k_stride_token, k_stride_head, q_stride_token, q_stride_head, k_stride_token, k_stride_head,
        interleave, stream));
}
}  // namespace

extern "C" {

// q: (tokens, q_heads, head_dim) and k: (tokens, k_heads, head_dim) of one dtype (bfloat16 or
// float16), rotated in place; is_neox: NeoX halves (FlashInfer's interleave = false). Returns the
// cudaError_t of the launch, or -1 where FlashInfer threw (fi_rope_last_error says what).
int fi_rope_pos_ids_cos_sin_cache(void* q, void* k, float* cos_sin_cache, int64_t* positions, unsigned tokens,
                                  unsigned q_heads, unsigned k_heads, unsigned rotary_dim, unsigned head_dim,
                                  size_t q_stride_token, size_t q_stride_head, size_t k_stride_token,
                                  size_t k_stride_head, int is_neox, int is_bf16, void* stream) {
    try {
        auto s = static_cast<cudaStream_t>(stream);
        if (is_bf16) {
            return apply_in_place<__nv_bfloat16>(q, k, cos_sin_cache, positions, tokens, q_heads, k_heads,
                                                 rotary_dim, head_dim, q_stride_token, q_stride_head,
                                                 k_stride_token, k_stride_head, !is_neox, s);
        }
        return apply_in_place<half>(q, k, cos_sin_cache, positions, tokens, q_heads, k_heads, rotary_dim, head_dim,
                                    q_stride_token, q_stride_head, k_stride_token, k_stride_head, !is_neox, s);
    } catch (const std::exception& e) {
        last_error = e.what();
        return -1;
    }
}

const char* fi_rope_last_error() { return last_error.c_str(); }

}  // extern "C"
