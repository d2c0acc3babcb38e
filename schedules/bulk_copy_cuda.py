"""CUDA device helpers: Hopper bulk copies (``cp.async.bulk``, the TMA unit) into shared memory,
completed through shared-memory barriers (``mbarrier``).

A decode GEMV at batch 1 is bound by how many bytes each SM has requested from HBM at a time.
Loads into registers cap that at what the warps can hold and issue; a bulk copy hands a whole
contiguous range (rows of a weight matrix) to the copy engine with one instruction, so a kernel
can request all of its weights within its first microsecond and compute on each piece as it
lands. Used by :mod:`dsv2_mlc.schedules.moe_gate_up_bulk_cuda`.

:func:`bulk_copy_source` defines, for sm_90 (the caller must not use them on older GPUs)::

    unsigned dsv2_smem_u32(const void* p)          // shared-memory address of a generic pointer
    void dsv2_mbar_init(unsigned long long* bar)   // one arrival per phase
    void dsv2_mbar_fence_init()                    // inits visible to the copy engine (+ barrier)
    void dsv2_mbar_expect_arrive(unsigned long long* bar, unsigned bytes)
    void dsv2_bulk_g2s(void* dst, const void* src, unsigned bytes, unsigned long long* bar)
    void dsv2_mbar_wait(unsigned long long* bar, unsigned parity)

``dsv2_mbar_expect_arrive`` is the phase's one arrival and announces the bytes the copies
completing on the barrier will bring (issue it before them); ``dsv2_mbar_wait(bar, 0)`` returns
once the first phase has completed, i.e. every announced byte has landed. Copies need 16-byte
aligned addresses and sizes. Each helper has a CPU branch (``#else`` of ``__CUDA_ARCH__``) that
calls the ``dsv2_emu_*`` functions of ``tests/cuda_emulation.py``, so the kernels run in the CPU
emulation of the tests.
"""

from __future__ import annotations

__all__ = ["bulk_copy_source"]

_SOURCE = r"""
#ifndef DSV2_BULK_COPY
#define DSV2_BULK_COPY
__device__ __forceinline__ unsigned dsv2_smem_u32(const void* p) {
#if defined(__CUDA_ARCH__)
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
#else
  return 0u;
#endif
}
__device__ __forceinline__ void dsv2_mbar_init(unsigned long long* bar) {
#if defined(__CUDA_ARCH__)
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(dsv2_smem_u32(bar)) : "memory");
#else
  dsv2_emu_mbar_init(bar);
#endif
}
__device__ __forceinline__ void dsv2_mbar_fence_init() {
#if defined(__CUDA_ARCH__)
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}
__device__ __forceinline__ void dsv2_mbar_expect_arrive(unsigned long long* bar, unsigned bytes) {
#if defined(__CUDA_ARCH__)
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
               :: "r"(dsv2_smem_u32(bar)), "r"(bytes) : "memory");
#else
  dsv2_emu_mbar_expect_arrive(bar, bytes);
#endif
}
__device__ __forceinline__ void dsv2_bulk_g2s(void* dst, const void* src, unsigned bytes,
                                              unsigned long long* bar) {
#if defined(__CUDA_ARCH__)
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      :: "r"(dsv2_smem_u32(dst)), "l"(src), "r"(bytes), "r"(dsv2_smem_u32(bar)) : "memory");
#else
  dsv2_emu_bulk_g2s(dst, src, bytes, bar);
#endif
}
__device__ __forceinline__ void dsv2_mbar_wait(unsigned long long* bar, unsigned parity) {
#if defined(__CUDA_ARCH__)
  unsigned done = 0;
  while (!done) {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done) : "r"(dsv2_smem_u32(bar)), "r"(parity) : "memory");
  }
#else
  dsv2_emu_mbar_wait(bar, parity);
#endif
}
#endif
"""


def bulk_copy_source() -> str:
    """The CUDA source of the helpers (module docstring)."""
    return _SOURCE
