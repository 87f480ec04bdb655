"""Where a model's ops run: the backend contract and its numpy reference (`base`), the Numba
CPU backend, the CUDA backend, the hybrid CPU/GPU dispatcher, and the offload plan that
decides which layers go to VRAM."""
