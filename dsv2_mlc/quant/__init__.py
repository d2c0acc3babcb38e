"""Weight quantization: the schemes (:mod:`.spec`), the INT4 packing in NumPy (:mod:`.packing`),
the quantised nn layers (:mod:`.modules`), the model rewrite (:mod:`.mutator`) and the INT4 decode
GEMV of a quantised linear layer (:mod:`.decode_linear`).

This package imports the kernels (``dsv2_mlc.schedules``) and nothing of the model or the passes;
the model imports it. Importing the package itself needs NumPy only (the runtime reads schemes and
dequantises weights without TVM); :mod:`.modules`, :mod:`.mutator` and :mod:`.decode_linear` need
TVM.
"""

from .packing import (
    dequantize_int4,
    packed_shape,
    quantize_blockwise,
    quantize_int4,
    quantize_params,
)
from .spec import (
    QUANTIZATIONS,
    Quantization,
    QuantizationError,
    QuantizedParam,
    get_quantization,
)

__all__ = [
    "QUANTIZATIONS",
    "Quantization",
    "QuantizationError",
    "QuantizedParam",
    "dequantize_int4",
    "get_quantization",
    "packed_shape",
    "quantize_blockwise",
    "quantize_int4",
    "quantize_params",
]
