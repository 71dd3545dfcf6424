"""The restore bench's evidence and floor (bench/floor.py): pure, on CPU."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench import floor, fs_l2_read


def test_mincore_sees_a_file_leave_the_page_cache_and_come_back(tmp_path: Path) -> None:
    path = tmp_path / "obj.data"
    path.write_bytes(os.urandom(1 << 20))
    floor.drop_cache([path])
    dropped = floor.resident_bytes(path)
    path.read_bytes()
    assert floor.resident_bytes(path) == 1 << 20
    assert dropped < 1 << 20 or fs_l2_read.machine(tmp_path)["fs"] == "tmpfs"  # keeps its pages


def test_residency_counts_each_file_with_a_page_in_the_cache(tmp_path: Path) -> None:
    paths = [tmp_path / f"{i}.data" for i in range(3)]
    for p in paths:
        p.write_bytes(os.urandom(1 << 16))
    floor.drop_cache(paths)
    paths[1].read_bytes()
    got = floor.residency([*paths, tmp_path / "gone.data"])
    assert got["files"] == 3 and got["bytes"] == 3 << 16 and got["missing_files"] == 1
    resident = 3 if fs_l2_read.machine(tmp_path)["fs"] == "tmpfs" else 1  # tmpfs keeps pages
    assert got["resident_files"] == resident and got["resident_bytes"] == resident << 16


def test_an_empty_file_has_nothing_resident(tmp_path: Path) -> None:
    (tmp_path / "e").write_bytes(b"")
    assert floor.resident_bytes(tmp_path / "e") == 0


def test_proc_io_is_parsed_by_field() -> None:
    text = "rchar: 10\nwchar: 20\nsyscr: 1\nread_bytes: 4096\nwrite_bytes: 0\n"
    assert floor.parse_proc_io(text) == {
        "rchar": 10,
        "wchar": 20,
        "syscr": 1,
        "read_bytes": 4096,
        "write_bytes": 0,
    }


def test_a_process_that_does_not_exist_has_no_read_bytes() -> None:
    assert floor.read_bytes(2**22 + 7) is None


def test_a_folder_with_no_writes_is_quiet_and_lists_its_files(tmp_path: Path) -> None:
    (tmp_path / "a.data").write_bytes(b"x" * 10)
    (tmp_path / "skip.tmp").write_bytes(b"x")
    got = floor.wait_quiet(tmp_path, ".data", min_files=1, quiet_s=0.3, timeout_s=5)
    assert got["quiet"] and list(got["files"]) == [str(tmp_path / "a.data")]


def test_a_folder_short_of_its_files_is_not_quiet(tmp_path: Path) -> None:
    got = floor.wait_quiet(tmp_path, ".data", min_files=1, quiet_s=0.1, timeout_s=0.6)
    assert not got["quiet"]


def test_the_ceiling_probe_reads_with_many_files_in_flight(tmp_path: Path) -> None:
    res = floor.ceiling_probe(tmp_path, 1 << 20, 8 << 20, threads=(1, 4))
    assert res["files"] == 8 and res["disk_gbps"] > 0 and res["page_cache_gbps"] > 0
    assert {"buffered-4", "cached-4"} <= set(res["passes"])
    assert res["passes"]["direct-4"] or res["direct-4_error"]  # tmpfs refuses O_DIRECT
    assert not list(tmp_path.iterdir())


def test_the_floor_is_bytes_at_the_ceiling_plus_the_fixed_cost() -> None:
    assert floor.floor_s(2e9, 4.0, 0.1) == pytest.approx(0.6)
    assert floor.floor_s(None, 4.0, 0.1) is None and floor.floor_s(2e9, 4.0, None) is None


def test_spread_is_median_min_max_of_the_values_present() -> None:
    assert floor.spread([3.0, None, 1.0, 2.0]) == {"n": 3, "median": 2.0, "min": 1.0, "max": 3.0}
    assert floor.spread([])["median"] is None
