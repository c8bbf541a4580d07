// cuda_attention.h: which kernel a CUDA backend runs Attention with.
//
// A plain enum, apart from cuda_backend.h, so that code built without CUDA
// (the engine's options, the device factory, the flags) can name the choice.
#ifndef HSX_KERNELS_CUDA_ATTENTION_H_
#define HSX_KERNELS_CUDA_ATTENTION_H_

namespace hsx {

// The tiled reference kernel (cuda/attention.cu; the CPU reference's
// arithmetic, batch invariant by construction) or cuDNN's SDPA
// (cuda/cudnn_attention.h; bf16 only, not yet validated on a GPU).
enum class CudaAttention { kReference, kCudnn };

}  // namespace hsx

#endif  // HSX_KERNELS_CUDA_ATTENTION_H_
