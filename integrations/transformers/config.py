"""``QLinearConfig``: the one user-facing config, also a transformers ``QuantizationConfigMixin``.

The same object drives :func:`qlinear.replace_linear`, ``QuantLinear.from_linear`` and
``AutoModelForCausalLM.from_pretrained(..., quantization_config=QLinearConfig(...))``; it is what
``save_pretrained`` writes to ``config.json["quantization_config"]`` (``quant_method="qlinear"``).
"""

from __future__ import annotations

from typing import Any, Optional

from transformers.utils.quantization_config import QuantizationConfigMixin

from qlinear.formats import FormatConfig, get_format

QUANT_METHOD = "qlinear"


def per_module_configs(per_module: Any) -> dict[str, Optional["QLinearConfig"]]:
    """``{pattern: QLinearConfig or None}`` in match order from a dict or a list of ``(pattern, config)`` pairs
    whose configs are QLinearConfigs, dicts of their options or None.

    Raises:
        TypeError: an entry that is none of those.
        ValueError: an entry with its own ``per_module`` or calibration data (those belong to the top level).
    """
    if per_module is not None and not isinstance(per_module, (dict, list, tuple)):
        raise TypeError(f"per_module must be a dict or a list of [pattern, config] pairs, got "
                        f"{type(per_module).__name__}")
    items = per_module.items() if isinstance(per_module, dict) else (per_module or [])
    out: dict[str, Optional[QLinearConfig]] = {}
    for item in items:
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)):
            raise TypeError(f"per_module must map name patterns to configs, got the entry {item!r}")
        pattern, c = item
        if isinstance(c, dict):
            c = QLinearConfig(**c)
        if c is not None and not isinstance(c, QLinearConfig):
            raise TypeError(f"per_module[{pattern!r}] must be a QLinearConfig, a dict of its options or None, "
                            f"got {type(c).__name__}")
        if c is not None and c.per_module:
            raise ValueError(f"per_module[{pattern!r}] has its own per_module: nesting is not supported")
        if c is not None and (c.dataset is not None or c.tokenizer is not None or c.finetune_steps):
            raise ValueError(f"per_module[{pattern!r}] has calibration data: pass dataset/tokenizer/finetune_steps "
                             f"on the top-level config (or calibration_data= to replace_linear), which calibrates "
                             f"every layer")
        out[pattern] = c
    return out


def check_patterns(patterns: Any) -> None:
    """Raise TypeError unless ``patterns`` (``modules_to_not_convert``) is None or a list/tuple of strings; a bare
    string, which would iterate as letters, is named."""
    if isinstance(patterns, str):
        raise TypeError(f"modules_to_not_convert must be a list of name patterns, got the string {patterns!r}: "
                        f"write [{patterns!r}]")
    if patterns is not None and not (isinstance(patterns, (list, tuple)) and all(isinstance(p, str) for p in patterns)):
        raise TypeError(f"modules_to_not_convert must be a list of name patterns (str), got {patterns!r}")


class QLinearConfig(QuantizationConfigMixin):
    """Quantization config for qlinear.

    Args:
        format: "bcq" (binary-coding, :class:`qlinear.BCQLinear`), "mixed" (2/4/16,
            :class:`qlinear.MixedPrecisionLinear`) or "codebook" (:class:`qlinear.CodebookLinear`).
        bits, group_size: per format; None takes the format's default (bcq 4/64, mixed 2/16,
            codebook 2/32).
        backend: kernel backend override ("reference", ...); None selects automatically.
        modules_to_not_convert: module-name patterns left in full precision (default ``["lm_head"]``).
        dataset: calibration data for quantize-on-load (texts, or integer token-id tensors), like
            transformers' ``GPTQConfig(dataset=...)``: ``from_pretrained`` then loads the float model,
            computes XᵀX per layer (:func:`qlinear.calibrate`) and quantizes with it (GPTQ, activation-aware
            BCQ/codebooks, error feedback).  Not saved with the model.
        tokenizer: tokenizer for text ``dataset`` entries (an object, or a name/path for ``AutoTokenizer``).
        finetune_steps: after quantize-on-load, distil the layers' scales from the float model for this many
            steps (:func:`qlinear.finetune`; a float copy of the model is held meanwhile) on ``dataset`` when it
            holds texts or token ids, else on 128 sequences of 256 tokens the float model samples itself
            (:func:`qlinear.generate_data`: no data needed).  0 (default): no distillation.  Not saved.
        per_module: ``{pattern: QLinearConfig | dict | None}`` (or a list of ``[pattern, config]`` pairs): the
            first pattern, in order, matching a module's name (:func:`qlinear.replace.matches`) gives its config
            instead of this one (None keeps it in float), e.g.
            ``{"*o_proj": QLinearConfig("bcq", method="gptq", act_order=True, static_groups=True)}``.  Saved
            with the model (as an ordered list), so ``from_pretrained`` rebuilds the same layers.
        **format_options: the format's other options (see ``qlinear.formats.<format>.Config``),
            e.g. ``iters=8`` (bcq), ``ratio_4bit=0.25`` (mixed), ``num_codebooks=4`` (codebook).

    Raises:
        ValueError / TypeError: unknown format, unknown option, or an option out of range (checked
        at construction).
    """

    def __init__(self, format: str = "bcq", bits: Optional[int] = None, group_size: Optional[int] = None,
                 backend: Optional[str] = None, modules_to_not_convert: Optional[list[str]] = None,
                 dataset: Any = None, tokenizer: Any = None, per_module: Any = None, finetune_steps: int = 0,
                 **format_options: Any):
        format_options.pop("quant_method", None)
        self.per_module = per_module_configs(per_module)
        check_patterns(modules_to_not_convert)
        if backend is not None and not isinstance(backend, str):
            raise TypeError(f"backend must be a backend name (str) or None, got {type(backend).__name__}")
        if dataset is not None and not isinstance(dataset, (list, tuple, dict)) and not hasattr(dataset, "dim"):
            raise TypeError(f"dataset must be a list of texts or token-id tensors, a token-id tensor or a dict of "
                            f"Hessians from qlinear.calibrate, got {type(dataset).__name__}")
        if tokenizer is not None and not (isinstance(tokenizer, str) or callable(tokenizer)):
            raise TypeError(f"tokenizer must be a tokenizer or its name/path, got {type(tokenizer).__name__}")
        self.dataset, self.tokenizer = dataset, tokenizer
        if isinstance(finetune_steps, bool) or not isinstance(finetune_steps, int) or finetune_steps < 0:
            raise ValueError(f"finetune_steps must be an int >= 0, got {finetune_steps!r}")
        self.finetune_steps = finetune_steps
        self.quant_method = QUANT_METHOD
        self.format = format
        self.bits = bits
        self.group_size = group_size
        self.backend = backend
        self.modules_to_not_convert = list(modules_to_not_convert) if modules_to_not_convert is not None \
            else ["lm_head"]
        self.format_options = dict(format_options)
        self.format_config()  # validate now

    def format_config(self) -> FormatConfig:
        """The validated per-format dataclass this config describes."""
        opts = dict(self.format_options)
        if self.bits is not None:
            opts["bits"] = self.bits
        if self.group_size is not None:
            opts["group_size"] = self.group_size
        return get_format(self.format).Config.from_dict({"format": self.format, **opts})

    def config_for(self, name: str, *aliases: str) -> Optional["QLinearConfig"]:
        """The config of module ``name``: the first ``per_module`` entry matching it or one of its ``aliases`` (its
        name in the model it was saved from; None: keep it in float), else this one.  ``modules_to_not_convert`` is
        the caller's to apply first."""
        from qlinear.replace import matches

        for pattern, c in self.per_module.items():
            if any(matches(n, pattern) for n in (name, *aliases)):
                return c
        return self

    def to_dict(self) -> dict[str, Any]:
        """What ``save_pretrained`` writes to ``config.json["quantization_config"]``; ``QLinearConfig(**d)``
        rebuilds it."""
        d = {"quant_method": QUANT_METHOD, "format": self.format, "bits": self.bits,
             "group_size": self.group_size, "backend": self.backend,
             "modules_to_not_convert": list(self.modules_to_not_convert), **self.format_options}
        if self.per_module:  # a list: config.json is written with sorted keys, and the first match wins
            d["per_module"] = [[p, None if c is None else {k: v for k, v in c.to_dict().items()
                                                           if k not in ("quant_method", "modules_to_not_convert")}]
                               for p, c in self.per_module.items()]
        return d

    def __repr__(self) -> str:
        return f"QLinearConfig({self.to_json_string(use_diff=False).strip()})"
