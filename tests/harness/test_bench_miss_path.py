"""The miss path's measurement hooks (bench/miss_path.py), on CPU."""

from __future__ import annotations

import time

import pytest

from bench import miss_path


class Connector:
    def save_kv_layer(self, name: str) -> str:
        time.sleep(0.01)
        return name


def test_a_wrapped_method_still_answers_and_its_calls_add_up() -> None:
    timer, conn = miss_path.CallTimer(), Connector()
    assert timer.wrap(conn, "worker", ["save_kv_layer", "absent"]) == ["worker.save_kv_layer"]
    assert conn.save_kv_layer("l0") == "l0" and conn.save_kv_layer("l1") == "l1"
    got = timer.take()
    assert got["worker.save_kv_layer"]["calls"] == 2 and got["worker.save_kv_layer"]["s"] >= 0.02
    assert timer.take() == {}  # taken once


def test_nothing_is_wrapped_without_a_connector() -> None:
    assert miss_path.CallTimer().wrap(None, "worker", miss_path.WORKER_METHODS) == []


def test_the_prefill_steps_are_those_that_began_before_the_first_token() -> None:
    steps = [{"t": 10.0, "s": 0.3}, {"t": 10.3, "s": 0.3}, {"t": 10.61, "s": 0.01}]
    assert miss_path.prefill_steps(steps, 0.6) == [0.3, 0.3]


def test_a_colds_writes_are_timed_from_the_request_start() -> None:
    files = {"a": (100, 1000.5), "b": (50, 1002.0)}
    got = miss_path.write_window(files, 1000.0)
    assert got == {"files": 2, "bytes": 150, "first_s": 0.5, "last_s": 2.0}


def test_the_servers_stores_in_a_window_are_counted() -> None:
    stores = [{"t": 1.0, "tokens": 528, "s": 0.1}, {"t": 5.0, "tokens": 528, "s": 0.2}]
    assert miss_path.server_stores(stores, 0.5, 4.0) == {"count": 1, "tokens": 528, "s": 0.1}


def test_the_summary_sets_the_misses_against_the_baseline() -> None:
    conn = {"worker.wait_for_save": {"calls": 3, "s": 0.4}, "scheduler.x": {"calls": 1, "s": 0.1}}
    misses = [{"ttft_s": 3.6, "steps_s": [0.6, 0.7], "connector": conn, "server": {"s": 0.2}}]
    base = [{"ttft_s": 2.8, "steps_s": [0.5, 0.5]}, {"ttft_s": 3.0, "steps_s": [0.5, 0.6]}]
    got = miss_path.summarize(misses, base)
    assert got["extra_s"] == pytest.approx(0.7) and got["miss_over_baseline"] == pytest.approx(
        3.6 / 2.9
    )
    assert (
        got["connector_s"] == pytest.approx(0.5)
        and got["by_method_s"]["worker.wait_for_save"] == 0.4
    )
    assert got["baseline_step_s"] == pytest.approx(0.525) and got["miss_step_s"] == pytest.approx(
        0.65
    )
