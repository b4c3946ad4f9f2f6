// FlashInfer's quantized RMSNorm kernels behind extern "C" entry points, the peer of the quant
// sub-command (loaded with ctypes). flashinfer.py prepares the headers and builds it:
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -shared -Xcompiler -fPIC -I.flashinfer/include \
//        cupy_rmsnorm/bench/flashinfer_quant.cu -o .flashinfer/libfiquant.so
//
// bfloat16 in, float8 e4m3 out, contiguous rows, programmatic dependent launch on (as ours).
// Each returns the cudaError_t of the launch.
#include <flashinfer/norm_rms.cuh>

using bf16 = __nv_bfloat16;
using fp8 = __nv_fp8_e4m3;
namespace fin = flashinfer::norm;

extern "C" {

// out = fp8(clamp(rms_norm(x) * w / scale)), scale: one float in device memory
int fi_rmsnorm_quant(void* x, void* w, void* out, unsigned rows, unsigned hidden, float* scale, float eps,
                     void* stream) {
    return static_cast<int>(fin::RMSNormQuant<bf16, fp8>(static_cast<bf16*>(x), static_cast<bf16*>(w),
                                                          static_cast<fp8*>(out), rows, hidden, hidden, hidden,
                                                          scale, eps, true, static_cast<cudaStream_t>(stream)));
}

// residual += x (in place), out = fp8(rms_norm(residual) * w / scale)
int fi_fused_add_rmsnorm_quant(void* x, void* residual, void* w, void* out, unsigned rows, unsigned hidden,
                               float* scale, float eps, void* stream) {
    return static_cast<int>(fin::FusedAddRMSNormQuant<bf16, fp8>(
        static_cast<bf16*>(x), static_cast<bf16*>(residual), static_cast<bf16*>(w), static_cast<fp8*>(out), rows,
        hidden, hidden, hidden, hidden, scale, eps, true, static_cast<cudaStream_t>(stream)));
}

// residual += x (in place); normed = bf16(rms_norm(residual) * w) (also written); out = fp8 of
// normed per 1x128 group; block_scale: (hidden / 128, round_up(rows, 4)) column-major floats
int fi_fused_add_rmsnorm_fp8_block_quant(void* x, void* residual, void* w, void* out, float* block_scale,
                                         void* normed, unsigned rows, unsigned hidden, float eps, void* stream) {
    const unsigned rows_padded = (rows + 3) & ~3u;
    return static_cast<int>(fin::FusedAddRMSNormFP8BlockQuant<bf16, fp8>(
        static_cast<bf16*>(x), static_cast<bf16*>(residual), static_cast<bf16*>(w), static_cast<fp8*>(out),
        block_scale, static_cast<bf16*>(normed), rows, hidden, hidden, hidden, hidden, hidden, rows_padded, eps,
        true, static_cast<cudaStream_t>(stream)));
}

}  // extern "C"
