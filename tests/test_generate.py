"""fagen.generate: writes only what changed and touches only the files its manifest owns."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from fagen.errors import InputError
from fagen.generate import MANIFEST, generate, read_manifest
from fagen.spec import KernelSpec

A = KernelSpec(direction="fwd", head_dim=32, dtype="float16")
B = KernelSpec(direction="fwd", head_dim=64, dtype="float16")
C = KernelSpec(direction="fwd", head_dim=32, dtype="bfloat16")


def _files(out: Path) -> set[str]:
    return {p.name for p in out.iterdir()}


def test_prune_removes_only_files_the_previous_manifest_owned(tmp_path: Path) -> None:
    (tmp_path / "mine.cu").write_text("// hand-written, not fagen's\n")
    (tmp_path / "notes.txt").write_text("keep\n")
    generate([A, B], tmp_path, prune=True)
    assert _files(tmp_path) == {f"{A.name}.cu", f"{B.name}.cu", MANIFEST, "mine.cu", "notes.txt"}
    changed = generate([A, C], tmp_path, prune=True)
    assert _files(tmp_path) == {f"{A.name}.cu", f"{C.name}.cu", MANIFEST, "mine.cu", "notes.txt"}
    assert (tmp_path / "mine.cu").read_text() == "// hand-written, not fagen's\n"
    assert set(changed) == {tmp_path / f"{C.name}.cu", tmp_path / f"{B.name}.cu", tmp_path / MANIFEST}
    assert [e["file"] for e in read_manifest(tmp_path)] == [f"{A.name}.cu", f"{C.name}.cu"]


def test_single_specs_accumulate_in_the_manifest(tmp_path: Path) -> None:
    generate([A], tmp_path)
    generate([B], tmp_path)
    assert sorted(e["file"] for e in read_manifest(tmp_path)) == sorted([f"{A.name}.cu", f"{B.name}.cu"])
    assert generate([B], tmp_path) == []  # nothing changed
    generate([C], tmp_path, prune=True)  # both earlier files were owned: both go
    assert _files(tmp_path) == {f"{C.name}.cu", MANIFEST}


def test_manifest_entries_outside_the_directory_are_never_removed(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    victim = tmp_path / "victim.cu"
    victim.write_text("x")
    (out / "data.json").write_text("{}")
    (out / MANIFEST).write_text(json.dumps([{"spec": {}, "file": "../victim.cu"}, {"spec": {}, "file": "data.json"}]))
    generate([A], out, prune=True)
    assert victim.exists() and (out / "data.json").exists()


@pytest.mark.parametrize("text", ["not json", '{"a": 1}', '[{"name": "x.cu"}]'])
def test_a_foreign_manifest_is_refused_and_left_alone(tmp_path: Path, text: str) -> None:
    (tmp_path / MANIFEST).write_text(text)
    (tmp_path / "other.cu").write_text("x")
    with pytest.raises(InputError, match="out: .*manifest.json"):
        generate([A], tmp_path, prune=True)
    assert (tmp_path / MANIFEST).read_text() == text and _files(tmp_path) == {MANIFEST, "other.cu"}
