"""Packaging hook: a wheel carries the shipped profile tables and cluster specs inside the package.

They live at the repository root (``profiles/``, ``clusters/``), where a checkout and an editable
install read them. A regular ``pip install .`` copies only packages, so ``build_py`` copies both trees
to ``baton/shipped/`` in the wheel; ``baton.profile`` and the README's commands find them there when
there is no checkout. (Everything else is declared in pyproject.toml.)
"""
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
SHIPPED = {"profiles": ("*.csv", "*.md", "*.yaml", "*.json"), "clusters": ("*.yaml", "*.md")}


class BuildWithShippedData(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install reads the checkout itself
        for tree, patterns in SHIPPED.items():
            src = ROOT / tree
            if not src.is_dir():
                continue
            for pattern in patterns:
                for f in src.rglob(pattern):
                    dest = Path(self.build_lib) / "baton" / "shipped" / tree / f.relative_to(src)
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(f, dest)


setup(cmdclass={"build_py": BuildWithShippedData})
