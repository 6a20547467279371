"""gbs: grouped (1D-1D) block-scaled matmul for MoE inference (NVFP4, MXFP4, MXFP8, W4A8).

Start with ``python -m gbs demo``; the public pieces:

* ``gbs.formats``: formats, ``quantize`` / ``dequantize``, FP4 packing, the 128x4 scale layout;
* ``gbs.problem``: ``GroupedProblem``, ``build_problem``, ``random_problem``;
* ``gbs.reference``: the exact reference and the acceptance metric;
* ``gbs.dispatch``: the SM100 three-regime dispatch;
* ``gbs.grouped_matmul``: run the grouped matmul on the best backend available;
* ``gbs.device_problem`` / ``gbs.DeviceGroupedProblem`` (``gbs.interop``): a problem whose arrays already live
  on the GPU (PyTorch, CuPy, Numba, ``__cuda_array_interface__``, DLPack), run without copies.
"""
from .api import grouped_matmul
from .interop import DeviceGroupedProblem, device_problem
from .problem import GroupedProblem, build_problem, random_problem
from .formats import BlockScaled, dequantize, quantize

__all__ = ["grouped_matmul", "GroupedProblem", "build_problem", "random_problem", "BlockScaled", "quantize",
           "dequantize", "DeviceGroupedProblem", "device_problem"]
__version__ = "0.1.0"
