/* A one-symbol stand-in for the NVIDIA driver library, for SGLang servers on CPU-only machines.
 *
 * sglang-kernel's CUDA extension (sgl_kernel/sm100/common_ops.abi3.so) links libcuda.so.1 for
 * cuPointerGetAttribute alone, and SGLang's CPU path imports sgl_kernel unconditionally, so the
 * import fails where no driver is installed. The symbol is never called on CPU; if it were, it
 * answers CUDA_ERROR_NOT_SUPPORTED (801) rather than pretending to succeed.
 * Built by tools/sglang_env.sh:  gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o libcuda.so.1 ...
 * It is put on LD_LIBRARY_PATH of CPU servers only (megatron_p3o/rollout/sglang/launch.py).
 */
int cuPointerGetAttribute(void *data, int attribute, unsigned long long ptr) {
  (void)data;
  (void)attribute;
  (void)ptr;
  return 801;
}
