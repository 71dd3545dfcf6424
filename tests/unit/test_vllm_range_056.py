"""The lmcache 0.5.6 based build serves vLLM 0.29-0.34 and refuses any other at engine start.

vLLM 0.34 re-sends a resumed request as a new one (no ``resumed_req_ids``) and allocates
the KV cache as driver-mapped memory (its extensible KV cache) unless the connector
declares, by ``kv_cache_access``, that it shares the cache through legacy CUDA IPC.
Pristine 0.5.6 crashes on the first cached request there and declares nothing. Run by
tests/run with vLLM 0.29.0, 0.31.0, 0.33.0 and 0.34.0 overlaid on the venv's vLLM.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytest.importorskip("lmcache")

import vllm  # noqa: E402
from vllm_sched_fakes import (  # noqa: E402
    BLOCK,
    RESUMED_AS_NEW,
    SchedDriver,
    make_connector,
    make_kv_cache_config,
)

pytestmark = pytest.mark.bases("0.5.6")
RANGE = r"vLLM >= 0\.29\.0, < 0\.35"


def _served(version: str) -> bool:
    major, minor = (int(x) for x in version.split(".")[:2])
    return (0, 29) <= (major, minor) < (0, 35)


@pytest.mark.feature
def test_this_vllm_is_served_or_refused(monkeypatch):
    config = make_kv_cache_config(num_spec_blocks=0)
    if _served(vllm.__version__):
        assert make_connector(config, BLOCK, monkeypatch) is not None
    else:
        with pytest.raises(RuntimeError, match=RANGE):
            make_connector(config, BLOCK, monkeypatch)


@pytest.mark.feature
@pytest.mark.parametrize("version", ["0.26.0", "0.28.0", "0.35.0", "1.0.0"])
def test_a_vllm_outside_the_range_is_refused_at_engine_start(version, monkeypatch):
    monkeypatch.setattr(vllm, "__version__", version)
    with pytest.raises(RuntimeError, match=RANGE):
        make_connector(make_kv_cache_config(num_spec_blocks=0), BLOCK, monkeypatch)


@pytest.mark.feature
def test_vllm_0_26_to_0_28_are_sent_to_the_0_5_3_build(monkeypatch):
    monkeypatch.setattr(vllm, "__version__", "0.27.1")
    with pytest.raises(RuntimeError, match=r"lmcache 0\.5\.3 based build.*hybridfa_build install"):
        make_connector(make_kv_cache_config(num_spec_blocks=0), BLOCK, monkeypatch)


@pytest.mark.feature
def test_a_vllm_without_the_resolved_layout_is_refused_naming_it(monkeypatch):
    from vllm.config.cache import CacheConfig

    monkeypatch.delattr(CacheConfig, "get_resolved_kv_cache_layout")
    with pytest.raises(RuntimeError, match="get_resolved_kv_cache_layout"):
        make_connector(make_kv_cache_config(num_spec_blocks=0), BLOCK, monkeypatch)


@pytest.mark.fix
def test_vllm_keeps_the_kv_cache_ipc_shareable_for_the_connector():
    """vLLM's own factory asks the connector loaded by module path how it reaches the
    KV cache; anything but LEGACY_IPC lets vLLM 0.34 allocate driver-mapped memory that
    the server's CUDA IPC import cannot map."""
    kv_transfer = pytest.importorskip("vllm.config.kv_transfer")
    if not hasattr(kv_transfer, "KVCacheAccess"):
        pytest.skip("this vLLM has no extensible KV cache")
    config = kv_transfer.KVTransferConfig(
        kv_connector="LMCacheMPConnector",
        kv_connector_module_path="lmcache.integration.vllm.lmcache_mp_connector",
        kv_role="kv_both",
    )
    assert config.kv_cache_access() == kv_transfer.KVCacheAccess.LEGACY_IPC


@pytest.mark.feature
def test_an_extensible_kv_cache_is_refused_naming_the_flag_to_turn_it_off(monkeypatch):
    from lmcache.integration.vllm import lmcache_mp_connector as mpc

    config = make_kv_cache_config(num_spec_blocks=0)
    real_init = mpc.LMCacheMPConnector.__init__

    def init_with_extensible_cache(self, vllm_config, *args, **kwargs):
        vllm_config.cache_config.enable_extensible_kv_cache = True
        real_init(self, vllm_config, *args, **kwargs)

    monkeypatch.setattr(mpc.LMCacheMPConnector, "__init__", init_with_extensible_cache)
    with pytest.raises(RuntimeError, match="--no-enable-extensible-kv-cache"):
        make_connector(config, BLOCK, monkeypatch)


@pytest.mark.fix
@pytest.mark.skipif(not RESUMED_AS_NEW, reason="this vLLM still sends resumed_req_ids")
def test_a_running_request_is_scheduled_on_a_vllm_without_resumed_req_ids(monkeypatch):
    """vLLM 0.34's CachedRequestData has no resumed_req_ids: the connector must build the
    metadata of a running request's next step (pristine raised AttributeError)."""
    config = make_kv_cache_config(num_spec_blocks=0)
    driver = SchedDriver(config, make_connector(config, BLOCK, monkeypatch))
    driver.add_request("r", list(range(4 * BLOCK)))
    driver.step({"r": BLOCK})
    try:
        driver.step({"r": BLOCK})
    except AttributeError as exc:
        pytest.fail(f"the connector crashed on a running request: {exc}")
    assert driver.tracked_table("r") == driver.vllm_table("r")
