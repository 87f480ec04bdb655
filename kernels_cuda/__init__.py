"""kernels_cuda of edgeinfer."""
