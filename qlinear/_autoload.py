"""Makes transformers know ``quant_method="qlinear"`` in every interpreter of an environment where qlinear is
installed, without ``import qlinear``: a saved qlinear checkpoint then loads quantized, or raises, and never loads as
random ``nn.Linear`` weights (transformers only warns about an unknown quant_method and skips quantization).

transformers has no plug-in discovery for quantizers, so the package installs ``qlinear-autoload.pth`` into
site-packages (``setup.py``), whose one line runs this file at interpreter start-up.  It imports nothing heavy: it puts
a one-shot finder on ``sys.meta_path`` that, right after ``transformers.quantizers.auto`` is executed, adds two
stand-ins under "qlinear" to its config and quantizer mappings.  The first time transformers uses one (loading a
qlinear checkpoint), the stand-in imports qlinear, whose ``register()`` puts the real classes in their place.  If the
``qlinear`` that imports is not this package (a folder of that name shadowing it) the stand-in raises ImportError.

The same way it adds ``optimum-cli qlinear ...`` (the :mod:`qlinear.cli` commands) once optimum's CLI module is
imported, through optimum's public ``optimum_cli_subcommand`` decorator: optimum's other plug-in routes (files in its
``optimum.commands.register`` namespace, a hard-coded list of sub-packages) do not reach an editable install.

Standard library only; loaded by path as ``qlinear._autoload`` (importing the ``qlinear`` package here would import
torch in every Python process).
"""

import importlib.util
import sys

TARGET = "transformers.quantizers.auto"
QUANT_METHOD = "qlinear"


def _real(mapping_name: str):
    """The class qlinear registers in ``transformers.quantizers.auto.<mapping_name>``, importing qlinear."""
    import qlinear  # noqa: F401  (registers the real classes)

    cls = getattr(sys.modules[TARGET], mapping_name)[QUANT_METHOD]
    if getattr(cls, "_qlinear_stand_in", False):
        where = getattr(sys.modules["qlinear"], "__file__", None) or list(getattr(sys.modules["qlinear"], "__path__", []))
        raise ImportError(f"this checkpoint needs the qlinear package, but 'import qlinear' imported {where}, which "
                          "did not register quant_method='qlinear' (a folder named qlinear shadowing the package?)")
    return cls


class StandInConfig:
    """Stands for ``qlinear.QLinearConfig`` until qlinear is imported."""

    _qlinear_stand_in = True

    @classmethod
    def from_dict(cls, *args, **kwargs):
        return _real("AUTO_QUANTIZATION_CONFIG_MAPPING").from_dict(*args, **kwargs)


class StandInQuantizer:
    """Stands for ``QLinearHfQuantizer`` until qlinear is imported."""

    _qlinear_stand_in = True

    def __new__(cls, *args, **kwargs):
        return _real("AUTO_QUANTIZER_MAPPING")(*args, **kwargs)


def _add_stand_ins(auto) -> None:
    auto.AUTO_QUANTIZATION_CONFIG_MAPPING.setdefault(QUANT_METHOD, StandInConfig)
    auto.AUTO_QUANTIZER_MAPPING.setdefault(QUANT_METHOD, StandInQuantizer)


class _AfterImport:
    """One-shot post-import hook: runs ``callback(module)`` right after module ``name`` is executed (a meta-path
    finder and the loader wrapping the real one; importlib.abc's bases are left out, they cost start-up time)."""

    def __init__(self, name, callback):
        self.name, self.callback = name, callback

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        self._loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = self._loader
        self._loader.exec_module(module)
        self.callback(module)


def after_import(name: str, callback) -> None:
    """Run ``callback(module)`` once module ``name`` is imported: now if it is, else right after its import (wrapt's
    post-import hooks, in a few lines: one finder per (name, callback) on ``sys.meta_path``)."""
    if name in sys.modules:
        callback(sys.modules[name])
    elif not any(isinstance(f, _AfterImport) and (f.name, f.callback) == (name, callback) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, callback))


def _add_optimum_command(optimum_cli) -> None:
    """Declare ``optimum-cli qlinear ARGS...``: ARGS go to :func:`qlinear.cli.main` unchanged."""
    import argparse

    from optimum.commands.base import BaseOptimumCLICommand, CommandInfo

    class QLinearCommand(BaseOptimumCLICommand):
        COMMAND = CommandInfo("qlinear", help="qlinear quantization: quantize, convert, eval, info (as the qlinear "
                                              "command)")

        @staticmethod
        def parse_args(parser):
            parser.add_argument("args", nargs=argparse.REMAINDER,
                                help="{quantize,convert,eval,info} and its options, as for the qlinear command "
                                     "(optimum-cli qlinear quantize --help)")

        def run(self):
            from qlinear.cli import main

            raise SystemExit(main(self.args.args or ["--help"]))

    optimum_cli.optimum_cli_subcommand()(QLinearCommand)


after_import(TARGET, _add_stand_ins)
after_import("optimum.commands.optimum_cli", _add_optimum_command)
