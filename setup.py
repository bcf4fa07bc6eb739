"""Everything is declared in pyproject.toml; this file only ships ``qlinear-autoload.pth`` into site-packages (the
start-up hook of :mod:`qlinear._autoload`), which pyproject metadata cannot express: wheels get it through build_py,
editable installs (PEP 660) through the editable wheel's root folder."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = Path(__file__).parent / "qlinear-autoload.pth"


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        self.copy_file(str(PTH), str(Path(self.build_lib, PTH.name)), preserve_mode=0)


class EditableWheelWithPth(editable_wheel):
    def _install_namespaces(self, installation_dir, pth_prefix):  # the one hook into the wheel's root folder
        super()._install_namespaces(installation_dir, pth_prefix)
        shutil.copy(PTH, Path(installation_dir, PTH.name))


setup(cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth})
