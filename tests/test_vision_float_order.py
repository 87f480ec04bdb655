"""vision.float_order: which encodes take ggml's float order."""
from edgeinfer.vision.float_order import EXACT_ORDER_MACS, FloatOrder


def test_ggml_order_holds_for_small_encodes_of_files_with_8_bit_matrices():
    order = FloatOrder(quantized=True, width=1152)
    n = int((EXACT_ORDER_MACS / 1152) ** 0.5)
    assert order.ggml_for(n) and not order.ggml_for(n + 1)
    assert not order.ggml_for(4096)          # a Gemma-3-4B image: BLAS's paths
    assert FloatOrder(True, 32).ggml_for(1881)   # the gemma4v fixture's 150x90 picture


def test_float_files_keep_blas_order():
    assert not FloatOrder(quantized=False, width=32).ggml_for(4)
