"""transformers integration: ``QLinearConfig`` (the ``quant_method="qlinear"`` config).

transformers has no entry-point discovery: run ``import qlinear`` before ``from_pretrained`` of a saved
qlinear checkpoint, otherwise transformers only warns about the unknown quant_method and loads random weights.
"""

from .config import QLinearConfig

__all__ = ["QLinearConfig"]
