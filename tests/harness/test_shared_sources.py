"""The modules every base shares live once, in sources/: each base's wheel holds them byte
for byte, and no patch of either series changes one."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
from factory_cli import factory

from hybridfa_build import factory as wheel_factory


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    built = {}
    for base in wheel_factory.base_names():
        out = tmp_path_factory.mktemp(f"dist-{base}")
        proc = factory("wheel", "--base", base, "--no-materialize", "--out", str(out))
        assert proc.returncode == 0, proc.stderr
        (built[base],) = out.glob("*.whl")
    return built


def test_every_base_holds_the_shared_modules_byte_for_byte(wheels: dict[str, Path]) -> None:
    shared = wheel_factory.shared_sources()
    assert shared, "sources/ carries no module"
    for base, wheel in wheels.items():
        with zipfile.ZipFile(wheel) as zf:
            for name in shared:
                expected = (wheel_factory.SOURCES_DIR / name).read_bytes()
                assert zf.read(name) == expected, f"{name} in the {base} wheel"


def test_no_patch_of_any_series_changes_a_shared_module() -> None:
    shared = set(wheel_factory.shared_sources())
    for base in wheel_factory.base_names():
        for patch in wheel_factory.read_series(wheel_factory.get_base(base).patches_dir):
            assert not wheel_factory.patched_paths(patch) & shared, patch.name


def test_a_patch_that_changes_a_shared_module_is_refused(tmp_path: Path) -> None:
    name = wheel_factory.shared_sources()[0]
    patch = tmp_path / "0001-x.patch"
    patch.write_text(f"diff --git a/{name} b/{name}\n")
    with pytest.raises(wheel_factory.BuildError, match="sources/ carries"):
        wheel_factory.check_no_shared_changes([patch])


def test_no_patch_of_any_series_adds_a_backup_or_reject_file() -> None:
    for base in wheel_factory.base_names():
        for patch in wheel_factory.read_series(wheel_factory.get_base(base).patches_dir):
            strays = [p for p in wheel_factory.patched_paths(patch)
                      if p.endswith((".orig", ".rej", "~"))]  # fmt: skip
            assert not strays, f"{patch.name} adds {strays}"
