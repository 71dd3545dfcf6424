"""Layout namespaces on the lmcache 0.5.6 base: a hybrid model's objects are keyed by
what their bytes mean, and what cannot be keyed is refused.

Pristine 0.5.6 keys a hybrid's objects by the bare model name, whatever layout wrote
them: the objects of an engine with another conv-state length (MTP), another fp8
format or other k/v scales, and those of pristine 0.5.6 or of the 0.5.3 based series,
are restored as if they were this engine's. The KV cache here is allocated by vLLM's own
code (vllm_kv_alloc), registered through the connector's real edits and group infos and
LMCache's real LMCacheDrivenTransferModule, whose storage manager is a small fake (no
bytes move: only keys and verdicts are checked).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("lmcache")

from handshake_client import (  # noqa: E402
    HandshakeClient,
    connect_to,
    one_gpu,
    real_server_experimental,
)
from vllm_kv_alloc import (  # noqa: E402
    CONV_WIDTH,
    FA_LAYERS,
    _Wrapper,
    build_registration,
    connector_view,
    layer_name,
)

pytestmark = pytest.mark.bases("0.5.6")

MODEL = "org/hybrid-3to1"
CHUNK = 16


class _Context(SimpleNamespace):
    """The server context's fields the module reads; weak-referenceable and hashed by
    identity as the real one (the server keeps per-context state in weak maps)."""

    __hash__ = object.__hash__


class Server:
    """LMCache's LMCacheDrivenTransferModule and LayoutDescRegistry; the storage
    manager is a fake that records what reaches it."""

    def __init__(self, separate_object_groups: bool = False) -> None:
        from lmcache.v1.multiprocess.engine_context import LayoutDescRegistry
        from lmcache.v1.multiprocess.modules import lmcache_driven_transfer as transfer

        self.reached: list[str] = []

        def record(name: str):
            return lambda *args, **kwargs: self.reached.append(name)

        storage = SimpleNamespace(
            l2_adapters=list,  # a server without an L2 tier
            **{
                n: record(n)
                for n in (
                    "finish_write",
                    "finish_write_by_owner",
                    "finish_read_prefetched",
                    "finish_read_by_owner",
                    "reserve_write",
                    "submit_write",
                )
            },
        )
        self.ctx = _Context(
            storage_manager=storage,
            chunk_size=CHUNK,
            separate_object_groups=separate_object_groups,
            full_sw_kv=False,
            layout_desc_registry=LayoutDescRegistry(),
            resolve_obj_keys=lambda key, gids: self.object_keys(key, gids),
        )
        self.module = transfer.LMCacheDrivenTransferModule(self.ctx)

    def register(self, instance_id: int, reg: Any, engine_identity: str | None = None) -> None:
        from lmcache.utils import EngineType

        edited, infos, hints = connector_view(reg, engine_identity)
        self.module.register_kv_cache(
            instance_id,
            [_Wrapper(t) for t in edited.values()],
            MODEL,
            1,
            EngineType.VLLM,
            hints,
            infos,
        )

    def unregister(self, instance_id: int) -> None:
        self.module.unregister_kv_cache(instance_id)

    @staticmethod
    def ipc_key() -> Any:
        from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey

        return IPCCacheServerKey(MODEL, 1, 0, tuple(range(CHUNK)), 0, CHUNK, "req-0")

    @staticmethod
    def object_keys(key: Any = None, gids: list[int] | None = None) -> list[list[Any]]:
        from lmcache.v1.distributed.api import ipc_key_to_object_keys

        return ipc_key_to_object_keys(key or Server.ipc_key(), [b"h" * 16], gids or [0])

    def model_name(self) -> str:
        """The model name the server keys this model's objects by, now."""
        return self.object_keys()[0][0].model_name


@pytest.fixture
def server():
    s = Server()
    yield s
    s.module.close()


@pytest.mark.fix
def test_hybrid_objects_are_not_keyed_as_pristine_keys_them(server):
    server.register(1, build_registration(16, 16, "LBNHC"))
    assert server.model_name() != MODEL, (
        "a hybrid's objects keyed by the bare model name: pristine 0.5.6's objects (and "
        "the 0.5.3 series') would be read as this layout's"
    )


@pytest.mark.fix
def test_an_mtp_engine_misses_the_objects_of_an_engine_without_mtp(server):
    server.register(1, build_registration(16, 16, "LBNHC"))
    without_mtp = server.model_name()
    server.unregister(1)
    server.register(2, build_registration(16, 16, "LBNHC", conv_state_len=CONV_WIDTH))
    assert server.model_name() != without_mtp, (
        "a conv state one token longer (MTP) keyed as the shorter one: its bytes are "
        "restored as the other layout's"
    )


@pytest.mark.fix
def test_the_same_layout_registered_again_keeps_its_keys(server):
    """A restart or rebuild that changes no stored byte keeps every hit (and the layout
    is keyed apart from pristine's, which the first assertion checks)."""
    server.register(1, build_registration(16, 16, "LBNHC"))
    first = server.model_name()
    assert first != MODEL, "keyed by the bare model name"
    server.unregister(1)
    server.register(2, build_registration(16, 16, "LBNHC", num_blocks=20))
    assert server.model_name() == first


@pytest.mark.fix
def test_live_engines_of_one_model_with_conflicting_layouts_are_refused(server):
    server.register(1, build_registration(16, 16, "LBNHC"))
    keys_a = server.model_name()
    server.register(2, build_registration(16, 16, "LBNHC", conv_state_len=CONV_WIDTH))
    during = server.model_name()
    assert during != keys_a, (
        "a second live engine of the model with another layout: the server keeps "
        "serving the first one's objects to both"
    )
    server.unregister(1)
    assert server.model_name() == during, "the conflict ended before every instance left"
    server.unregister(2)
    server.register(3, build_registration(16, 16, "LBNHC"))
    assert server.model_name() == keys_a, "the layout's keys after the conflict ended"


@pytest.mark.feature
def test_a_refused_engine_stores_nothing_and_gets_no_error(server):
    from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey

    server.register(1, build_registration(16, 16, "LBNHC"))
    server.register(2, build_registration(16, 16, "LBNHC", conv_state_len=CONV_WIDTH))
    key = IPCCacheServerKey(MODEL, 1, 0, tuple(range(CHUNK)), 0, CHUNK, "req-1")
    for instance in (1, 2):
        handle, ok, stored = server.module.store_with_chunk_mask(key, instance, [[1]] * 4, b"")
        assert (handle, ok) == (b"", True) and stored and not any(stored)
    assert server.reached == []


@pytest.mark.feature
def test_an_undeclared_hybrid_client_is_refused(server):
    """A pristine engine (no layout declaration) registering a hybrid: its stores would
    hold pristine's layout under this series' keys."""
    import msgspec

    from lmcache.utils import EngineType

    edited, infos, hints = connector_view(build_registration(16, 16, "LBNHC"))
    pristine_infos = [msgspec.structs.replace(i, layout_format=0) for i in infos]
    server.register(1, build_registration(16, 16, "LBNHC"))
    declared = server.model_name()
    server.unregister(1)
    server.module.register_kv_cache(
        2,
        [_Wrapper(t) for t in edited.values()],
        MODEL,
        1,
        EngineType.VLLM,
        hints,
        pristine_infos,
    )
    assert server.model_name() not in (MODEL, declared)


def _engine(kv_cache_dtype: str, k_scale: float = 1.0, calculate: bool = False) -> Any:
    """The parts of vLLM's config that say what the stored KV bytes are computed from:
    the model, the KV cache's dtype and each attention layer's loaded scales."""
    import torch

    layers = {
        layer_name(i): SimpleNamespace(
            kv_cache_dtype=kv_cache_dtype,
            calculate_kv_scales=calculate,
            _k_scale=torch.tensor(k_scale),
            _v_scale=torch.tensor(1.0),
        )
        for i in FA_LAYERS
    }
    return SimpleNamespace(
        model_config=SimpleNamespace(
            model=MODEL,
            revision="r1",
            code_revision=None,
            quantization=None,
            dtype="bfloat16",
            hf_overrides=None,
            model_weights="",
        ),
        load_config=SimpleNamespace(load_format="auto", download_dir=None),
        cache_config=SimpleNamespace(cache_dtype=kv_cache_dtype, calculate_kv_scales=calculate),
        compilation_config=SimpleNamespace(static_forward_context=layers),
    )


def _identity(vllm_config: Any) -> str:
    from lmcache.integration.vllm.identity import engine_identity, engine_identity_digest

    names = [layer_name(i) for i in range(8)]
    return engine_identity_digest(engine_identity(vllm_config, names))


@pytest.mark.feature
@pytest.mark.parametrize(
    ("a", "b"),
    [
        (("fp8_e4m3", 1.0), ("fp8_e5m2", 1.0)),
        (("fp8_e4m3", 1.0), ("fp8_e4m3", 0.5)),
        (("auto", 1.0), ("fp8", 1.0)),
    ],
    ids=["fp8-format", "k-scale", "quantized"],
)
def test_engines_of_another_kv_quantization_miss_each_other(server, a, b):
    """vLLM stores fp8_e4m3 and fp8_e5m2 alike (uint8 tensors of one spec): only the
    engine identity tells their bytes apart."""
    reg = build_registration(16, 16, "LBNHC")
    server.register(1, reg, engine_identity=_identity(_engine(*a)))
    first = server.model_name()
    server.unregister(1)
    server.register(2, reg, engine_identity=_identity(_engine(*b)))
    assert server.model_name() != first
    server.unregister(2)
    server.register(3, reg, engine_identity=_identity(_engine(*a)))
    assert server.model_name() == first


@pytest.mark.feature
def test_calculated_kv_scales_refuse_the_cache():
    from lmcache.integration.vllm.lmcache_mp_connector import hybrid_cache_refusal
    from lmcache.v1.distributed.layout_namespace import LAYOUT_FORMAT

    calculated = _engine("fp8_e4m3", calculate=True)
    reason = hybrid_cache_refusal(calculated, True, LAYOUT_FORMAT)
    assert reason is not None and "--calculate-kv-scales" in reason
    assert hybrid_cache_refusal(_engine("fp8_e4m3"), True, LAYOUT_FORMAT) is None
    assert hybrid_cache_refusal(_engine("auto", calculate=True), True, LAYOUT_FORMAT) is None
    assert hybrid_cache_refusal(calculated, False, LAYOUT_FORMAT) is None  # no recurrent state


@pytest.mark.feature
def test_the_server_advertises_its_layout_format_and_the_client_reads_it():
    from concurrent.futures import Future

    from lmcache.integration.vllm.vllm_multi_process_adapter import get_experimental
    from lmcache.v1.distributed.layout_namespace import LAYOUT_FORMAT, server_layout_format
    from lmcache.v1.multiprocess.modules.management import ManagementModule

    advertised = ManagementModule(SimpleNamespace()).get_experimental()
    reply: Future = Future()
    reply.set_result(advertised)
    client = SimpleNamespace(get_experimental=lambda: reply)
    assert server_layout_format(get_experimental(client, timeout=1)) == LAYOUT_FORMAT
    assert LAYOUT_FORMAT != 3, "the 0.5.3 series' format: its objects would share keys"


@pytest.fixture
def scheduler_adapter(monkeypatch: pytest.MonkeyPatch):
    """``make(chunk, replies)``: LMCache's real LMCacheMPSchedulerAdapter over one
    server per GET_EXPERIMENTAL reply."""
    import zmq

    from lmcache.integration.vllm import vllm_multi_process_adapter as vmpa

    ctx = zmq.Context()

    def make(chunk: int, replies: list[list[str]]) -> Any:
        connect_to(monkeypatch, *[HandshakeClient(chunk, reply) for reply in replies])
        urls = [f"tcp://127.0.0.1:{5555 + i}" for i in range(len(replies))]
        strategy = one_gpu(n_servers=len(replies))
        return vmpa.LMCacheMPSchedulerAdapter(urls, ctx, MODEL, chunk, strategy, mq_timeout=5.0)

    yield make
    ctx.destroy(linger=0)


@pytest.mark.feature
def test_the_scheduler_adapter_keeps_what_every_server_advertises(scheduler_adapter):
    from lmcache.v1.distributed.layout_namespace import LAYOUT_FORMAT, server_layout_format

    this_build = real_server_experimental()
    one = scheduler_adapter(CHUNK, [this_build])
    assert server_layout_format(one.experimental) == LAYOUT_FORMAT
    beside_pristine = scheduler_adapter(CHUNK, [this_build, ["transfer_query"]])
    assert server_layout_format(beside_pristine.experimental) == 0


@pytest.mark.feature
def test_a_hybrid_engine_over_the_real_scheduler_adapter_is_served(scheduler_adapter, monkeypatch):
    """The scheduler-side connector built over LMCache's real adapter (whose server is
    this build's) starts and keeps the hybrid cache."""
    from vllm_sched_fakes import BLOCK, make_connector, make_kv_cache_config

    adapter = scheduler_adapter(BLOCK, [real_server_experimental()])
    connector = make_connector(make_kv_cache_config(0), BLOCK, monkeypatch, adapter=adapter)
    assert connector._cache_refused is None


@pytest.mark.feature
def test_a_pristine_server_refuses_the_hybrid_cache():
    from lmcache.integration.vllm.lmcache_mp_connector import hybrid_cache_refusal
    from lmcache.v1.distributed.layout_namespace import LAYOUT_FORMAT, server_layout_format

    pristine = server_layout_format({"transfer_query"})
    reason = hybrid_cache_refusal(_engine("auto"), True, pristine)
    assert reason is not None and "pristine" in reason
    assert hybrid_cache_refusal(_engine("auto"), True, 3) is not None  # the 0.5.3 series
    assert hybrid_cache_refusal(_engine("auto"), False, pristine) is None
    assert hybrid_cache_refusal(_engine("auto"), True, LAYOUT_FORMAT) is None


@pytest.mark.feature
def test_a_hybrid_engine_facing_a_pristine_server_stores_and_loads_nothing(monkeypatch):
    """The real scheduler-side connector over vLLM's KVCacheManager (vllm_sched_fakes)
    whose server answers GET_EXPERIMENTAL as pristine 0.5.6 does."""
    from vllm_sched_fakes import BLOCK, SchedDriver, make_connector, make_kv_cache_config

    stores = {}
    for server_format in (None, 0):  # this build's server, a pristine one
        config = make_kv_cache_config(0)
        connector = make_connector(config, BLOCK, monkeypatch, server_layout_format=server_format)
        driver = SchedDriver(config, connector)
        driver.add_request("r", list(range(4 * BLOCK)))
        stores[server_format] = [op for _ in range(4) for op in driver.step({"r": BLOCK}).stores]
    assert stores[None], "this build's server: the prompt's chunks are stored"
    assert stores[0] == []
