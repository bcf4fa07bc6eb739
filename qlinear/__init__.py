"""qlinear: quantized ``nn.Linear`` replacements for LLM inference.

Formats: BCQ (:class:`BCQLinear`), mixed 2/4/16 (:class:`MixedPrecisionLinear`) and group-wise
codebooks (:class:`CodebookLinear`).  ``replace_linear(model, QLinearConfig(...))`` swaps a model's
Linear layers; importing qlinear also registers the ``quant_method="qlinear"`` transformers quantizer and,
when PEFT is imported, LoRA on qlinear layers (:mod:`qlinear.integrations.peft`).
"""

from .modules import BCQLinear, CodebookLinear, MixedPrecisionLinear, QuantLinear, describe  # noqa: E402
from qlinear.integrations.transformers import QLinearConfig, init_empty_quantized  # noqa: E402
from .calibration import calibrate, generate_data  # noqa: E402
from .finetune import finetune  # noqa: E402
from .replace import replace_linear  # noqa: E402
from qlinear.integrations.gptq_awq import load_awq, load_gptq, save_awq, save_gptq  # noqa: E402
from qlinear.integrations import tensor_parallel  # noqa: E402
from qlinear.integrations import peft as _peft  # noqa: E402

_peft.install_when_imported()  # LoRA on qlinear layers through PEFT's own API, without importing PEFT here

__version__ = "0.1.0"
__all__ = ["QLinearConfig", "QuantLinear", "BCQLinear", "MixedPrecisionLinear", "CodebookLinear", "replace_linear",
           "init_empty_quantized", "calibrate", "generate_data", "finetune", "load_gptq", "save_gptq", "load_awq",
           "save_awq", "tensor_parallel", "describe"]
