"""Package layout (the rest of the metadata is in pyproject.toml).

``templates/`` lives at the top level of the repository and is mapped into the
package as ``fagen._templates``; each of its subdirectories (``simt``,
``partials``, a new family's folder ...) is declared as a data-only subpackage,
found here rather than listed by hand, so setuptools neither warns that it
"would be ignored" nor fails on a folder that does not exist yet.
tests/test_packaging.py builds the wheel and renders from the installed copy.
"""
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
TEMPLATE_DIRS = sorted(p.name for p in (ROOT / "templates").iterdir() if p.is_dir() and p.name != "__pycache__")
TEMPLATE_FILES = ["*.j2", "*.cuh", "*.h"]

setup(
    packages=find_packages(include=["fagen", "fagen.*"])
    + ["fagen._templates"] + [f"fagen._templates.{d}" for d in TEMPLATE_DIRS],
    package_dir={"fagen": "fagen", "fagen._templates": "templates"},
    package_data={
        "fagen._templates": TEMPLATE_FILES,
        **{f"fagen._templates.{d}": TEMPLATE_FILES for d in TEMPLATE_DIRS},
        "fagen.emulator": ["*.h", "*.cpp"],
        "fagen.families.mma": ["codegen_table.json"],  # the stored search's table (fagen tune-codegen)
        "fagen.families.wgmma": ["codegen_table.json"],
    },
)
