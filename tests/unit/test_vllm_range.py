"""The connector serves vLLM 0.26-0.28 and refuses any other at engine start.

Later vLLM releases changed interfaces the connector reads (0.29 removed
get_kv_cache_layout; 0.33 ignores mamba_cache_mode; 0.34 drops resumed_req_ids). Outside the
range the real scheduler-side LMCacheMPConnector must refuse with one error naming the range, not
crash deep inside or misread a layout. Run on this venv's vLLM and, by tests/run, on
vLLM 0.27.1 and 0.28.0 overlaid on it.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytest.importorskip("lmcache")

import vllm  # noqa: E402
from vllm_sched_fakes import BLOCK, make_connector, make_kv_cache_config  # noqa: E402

RANGE = r"vLLM >= 0\.26\.0, < 0\.29"


def _served(version: str) -> bool:
    major, minor = (int(x) for x in version.split(".")[:2])
    return (0, 26) <= (major, minor) < (0, 29)


def test_this_vllm_is_served_or_refused(monkeypatch):
    config = make_kv_cache_config(num_spec_blocks=0)
    if _served(vllm.__version__):
        assert make_connector(config, BLOCK, monkeypatch) is not None
    else:
        with pytest.raises(RuntimeError, match=RANGE):
            make_connector(config, BLOCK, monkeypatch)


@pytest.mark.feature
@pytest.mark.parametrize("version", ["0.29.0", "0.33.0", "0.25.1", "1.0.0"])
def test_a_vllm_outside_the_range_is_refused_at_engine_start(version, monkeypatch):
    monkeypatch.setattr(vllm, "__version__", version)
    with pytest.raises(RuntimeError, match=RANGE):
        make_connector(make_kv_cache_config(num_spec_blocks=0), BLOCK, monkeypatch)


@pytest.mark.feature
def test_a_later_vllm_is_pointed_to_the_0_5_6_based_build(monkeypatch):
    monkeypatch.setattr(vllm, "__version__", "0.31.0")
    with pytest.raises(RuntimeError, match=r"install --base 0\.5\.6"):
        make_connector(make_kv_cache_config(num_spec_blocks=0), BLOCK, monkeypatch)


@pytest.mark.feature
def test_a_vllm_without_the_layout_hint_is_refused_naming_it(monkeypatch):
    from vllm.v1.attention.backends import utils

    monkeypatch.setattr(vllm, "__version__", "0.28.0")
    monkeypatch.delattr(utils, "get_kv_cache_layout", raising=False)
    with pytest.raises(RuntimeError, match="get_kv_cache_layout"):
        make_connector(make_kv_cache_config(num_spec_blocks=0), BLOCK, monkeypatch)


@pytest.mark.feature
def test_a_vllm_without_resumed_req_ids_is_refused_naming_it(monkeypatch):
    import dataclasses

    from vllm.v1.core.sched import output

    monkeypatch.setattr(vllm, "__version__", "0.28.0")
    fields = [
        f for f in dataclasses.fields(output.CachedRequestData) if f.name != "resumed_req_ids"
    ]
    monkeypatch.setattr(
        output.CachedRequestData, "__dataclass_fields__", {f.name: f for f in fields}
    )
    with pytest.raises(RuntimeError, match="resumed_req_ids"):
        make_connector(make_kv_cache_config(num_spec_blocks=0), BLOCK, monkeypatch)
