"""transformers integration: ``QLinearConfig`` and the ``quant_method="qlinear"`` HfQuantizer.

Registered when qlinear is imported, and lazily in any interpreter of an environment where qlinear is installed
(transformers has no entry-point discovery; see :mod:`qlinear._autoload`), so ``from_pretrained`` of a saved
qlinear checkpoint works without ``import qlinear``.
"""

import warnings

from .config import QLinearConfig

try:  # the quantizer uses transformers 5 loading internals; an older 5.x must not break the rest of qlinear
    from .quantizer import QLinearHfQuantizer, init_empty_quantized, register
except ImportError as e:  # pragma: no cover - depends on the installed transformers
    import transformers

    warnings.warn(f"qlinear's from_pretrained integration is unavailable with transformers {transformers.__version__}: "
                  f"{e}; replace_linear and the modules still work", stacklevel=2)
    QLinearHfQuantizer = init_empty_quantized = None
else:
    register()

__all__ = ["QLinearConfig", "QLinearHfQuantizer", "init_empty_quantized"]
