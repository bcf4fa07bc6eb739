"""transformers integration: ``QLinearConfig`` and the ``quant_method="qlinear"`` HfQuantizer.

Registered when qlinear is imported.  transformers has no entry-point discovery: run
``import qlinear`` before ``from_pretrained`` of a saved qlinear checkpoint, otherwise transformers
only warns about the unknown quant_method and loads random weights.
"""

from .config import QLinearConfig
from .quantizer import QLinearHfQuantizer, register

register()

__all__ = ["QLinearConfig", "QLinearHfQuantizer"]
