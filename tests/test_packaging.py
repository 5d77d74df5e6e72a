"""The wheel carries the templates: build it, install it outside the tree, render from there."""
from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    build = tmp_path_factory.mktemp("build")
    res = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(REPO)],
        capture_output=True, text=True, timeout=600, cwd=build,
    )
    assert res.returncode == 0, res.stderr
    (whl,) = out.glob("fagen-*.whl")
    return whl


def test_wheel_contains_templates_and_shim(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    templates = sorted(p.relative_to(REPO / "templates").as_posix() for p in (REPO / "templates").rglob("*") if p.is_file())
    for t in templates:
        assert f"fagen/_templates/{t}" in names, t
    assert "fagen/emulator/shim.h" in names
    assert any(n.endswith("entry_points.txt") for n in names)


def test_installed_wheel_renders_outside_source_tree(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    res = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    script = (
        "import fagen, fagen.renderer as r\n"
        "src = r.render(fagen.KernelSpec(head_dim=64, causal=True, dropout=True)).source\n"
        "print(fagen.__file__); print(r.templates_dir()); print(len(src))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(target)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    file_, tdir, n = res.stdout.split()
    assert file_.startswith(str(target)) and tdir.startswith(str(target))
    assert int(n) > 1000


def test_build_is_quiet(tmp_path: Path) -> None:
    """No setuptools deprecation or "Package would be ignored" warnings in the build log."""
    res = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v", "-w", str(tmp_path / "w"),
         str(REPO)], capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    log = res.stdout + res.stderr
    for noise in ("Warning", "would be ignored", "deprecated"):
        assert noise not in log, log[log.find(noise) - 500:log.find(noise) + 500]
