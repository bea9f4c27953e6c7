// Dequantization to f32 or f16, one thread per ggml block (32 or 256 elements;
// one element for f32/f16/bf16). Each thread runs the CPU's MG_HD block
// function, so the GPU result is the CPU result bit for bit (f16: the CPU's
// floats rounded by f32_to_f16). This is the checking and staging path, not the
// matvec path: a thread writes its block's values itself, so stores are not
// coalesced across the warp.
#include "kernels/dequant.h"
#include "kernels/launch.cuh"
#include "loader/quant.h"

namespace moegraph {
namespace {

constexpr int kThreadsPerBlock = 256;

constexpr int kMaxBlockElems = 256;

// Out: float, or uint16_t for f16 bits.
template <typename Out>
__global__ void dequantize_blocks(GgmlType type, const uint8_t* __restrict__ src,
                                  Out* __restrict__ dst, int64_t n_blocks, int64_t block_elems,
                                  int64_t block_bytes) {
  wait_for_prior_grids();
  const int64_t block = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (block >= n_blocks) return;
  if constexpr (sizeof(Out) == 4) {
    dequantize_block(type, src + block * block_bytes, dst + block * block_elems);
  } else {
    float values[kMaxBlockElems];
    dequantize_block(type, src + block * block_bytes, values);
    for (int64_t i = 0; i < block_elems; ++i) dst[block * block_elems + i] = f32_to_f16(values[i]);
  }
}

template <typename Out>
cudaError_t launch(GgmlType type, const void* src, Out* dst, int64_t n, cudaStream_t stream) {
  const int64_t block_elems = quant_block_elems(type);
  if (block_elems == 0 || block_elems > kMaxBlockElems || n < 0 || n % block_elems != 0) {
    return cudaErrorInvalidValue;
  }
  const int64_t n_blocks = n / block_elems;
  if (n_blocks == 0) return cudaSuccess;
  const int64_t grid = (n_blocks + kThreadsPerBlock - 1) / kThreadsPerBlock;
  return launch_kernel<dequantize_blocks<Out>>(static_cast<unsigned>(grid), kThreadsPerBlock,
                                               stream, type, static_cast<const uint8_t*>(src), dst,
                                               n_blocks, block_elems, quant_block_bytes(type));
}

}  // namespace

cudaError_t launch_dequantize(GgmlType type, const void* src, float* dst, int64_t n,
                              cudaStream_t stream) {
  return launch(type, src, dst, n, stream);
}

cudaError_t launch_dequantize_f16(GgmlType type, const void* src, uint16_t* dst, int64_t n,
                                  cudaStream_t stream) {
  return launch(type, src, dst, n, stream);
}

}  // namespace moegraph
