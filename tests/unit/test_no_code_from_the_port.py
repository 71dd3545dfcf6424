"""Whoever reaches the server's message queue cannot make it run code.

Pristine LMCache unpickles what a client of the message queue sends: the KV caches an
engine registers (0.5.3: ``DeviceIPCWrapper.Deserialize`` is ``pickle.loads``) and the
chunks of an engine-driven store without shared memory (``COMMIT_STORE``, both bases).
A pickle names any callable to run. Here both are data only: a registration is a tagged
record of the wrapper's fields, a chunk its dtype, shape and bytes. A hostile or
malformed message is refused and logged, and the server keeps serving.

Real classes: LMCache's DeviceIPCWrapper and its message-queue server (0.5.3), the
engine-driven transfer strategy over a real StorageManager (both bases). A payload
whose unpickling would create a file stands in for an attacker's code.
"""

from __future__ import annotations

import os
import pickle
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.bases("0.5.3", "0.5.6")


class Planted:
    """Unpickling it creates ``path``: the code a client could make the server run."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (self.path,))


def strategy() -> Any:
    """The engine-driven transfer without shared memory, over a real StorageManager."""
    from lmcache.v1.distributed.config import parse_args
    from lmcache.v1.distributed.storage_manager import StorageManager
    from lmcache.v1.multiprocess.modules.server_transfer import PickleTransferStrategy

    manager = StorageManager(parse_args(["--l1-size-gb", "0.05", "--eviction-policy", "LRU"]))
    return PickleTransferStrategy(manager), manager


def commit(transfer: Any, payload: bytes, shape: tuple[int, ...]) -> bool:
    from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
    from lmcache.v1.multiprocess.transfer_context.base import EngineDrivenContextMetadata

    key = ObjectKey(chunk_hash=b"\x07" * 32, model_name="m", kv_rank=0)
    layout = MemoryLayoutDesc(shapes=[torch.Size(shape)], dtypes=[torch.bfloat16])
    context = EngineDrivenContextMetadata(layout_desc=layout, block_size=16, use_mla=False)
    return bool(transfer.commit_store(None, 1, payload, context, lambda _key: [key]))


@pytest.fixture
def transfer() -> Any:
    transfer, manager = strategy()
    try:
        yield transfer
    finally:
        manager.close()


@pytest.mark.fix
def test_an_engine_driven_store_runs_no_code_it_carries(transfer, tmp_path):
    planted = tmp_path / "ran"
    try:
        commit(transfer, pickle.dumps([Planted(planted)]), (2, 16, 8))
    except Exception:  # a refusal may raise; running the code may not happen at all
        pass
    assert not planted.exists(), "the server ran code a store carried"


@pytest.mark.feature
def test_an_engine_driven_store_of_tensor_data_is_stored(transfer):
    from lmcache.v1.multiprocess.tensor_wire import decode_tensors, encode_tensors

    chunk = torch.randn(2, 16, 8).to(torch.bfloat16)
    assert decode_tensors(encode_tensors([chunk]))[0].equal(chunk)
    assert commit(transfer, encode_tensors([chunk]), tuple(chunk.shape))


@pytest.mark.feature
@pytest.mark.parametrize(
    "payload",
    [b"", b"\x93\xa4junk", b"\x91\x93\xa8bfloat16\x91\x02\xc4\x03abc"],
    ids=["empty", "not-chunks", "short-bytes"],
)
def test_an_engine_driven_store_of_other_bytes_is_refused(transfer, payload):
    assert not commit(transfer, payload, (2, 16, 8))


@pytest.mark.fix
@pytest.mark.bases("0.5.3")
def test_a_kv_cache_registration_runs_no_code_it_carries(tmp_path):
    from lmcache.v1.platform.base.ipc_wrapper import DeviceIPCWrapper

    planted = tmp_path / "ran"
    try:
        DeviceIPCWrapper.Deserialize(pickle.dumps(Planted(planted)))
    except ValueError:
        pass
    assert not planted.exists(), "a registration's KV cache wrapper ran code"


@pytest.mark.feature
@pytest.mark.bases("0.5.3")
def test_a_cpu_kv_cache_wrapper_crosses_the_wire_as_its_fields():
    from lmcache.v1.platform.base.ipc_wrapper import DeviceIPCWrapper
    from lmcache.v1.platform.cpu.shm import CpuShmTensorWrapper

    wrapper = CpuShmTensorWrapper.__new__(CpuShmTensorWrapper)
    wrapper.__dict__.update(
        shm_name="/lmcache_kv_1_2", nbytes=256, handle=None, dtype=torch.bfloat16,
        shape=(8, 16), stride=(16, 1), storage_offset=0, device_uuid="cpu",
    )  # fmt: skip
    back = DeviceIPCWrapper.Deserialize(DeviceIPCWrapper.Serialize(wrapper))
    assert type(back) is CpuShmTensorWrapper and back == wrapper
    assert back.shm_name == wrapper.shm_name and back.nbytes == wrapper.nbytes


@pytest.mark.feature
@pytest.mark.bases("0.5.3")
@pytest.mark.parametrize(
    "change",
    [{"shm_name": "/other_app_segment"}, {"nbytes": 64}, {"dtype": "no_such_dtype"}],
    ids=["foreign-segment", "view-beyond-it", "unknown-dtype"],
)
def test_a_registration_record_that_does_not_add_up_is_refused(change):
    import msgspec

    from lmcache.v1.platform.base.ipc_wrapper import DeviceIPCWrapper

    record = {
        "kind": "cpu_shm", "shm_name": "/lmcache_kv_1_2", "nbytes": 256,
        "view": {"dtype": "bfloat16", "shape": [8, 16], "stride": [16, 1],
                 "storage_offset": 0, "device_uuid": "cpu"},
    }  # fmt: skip
    for name, value in change.items():
        (record["view"] if name == "dtype" else record)[name] = value
    with pytest.raises(ValueError):
        DeviceIPCWrapper.Deserialize(msgspec.msgpack.encode(record))


def answer_ping(instance_id: int | None) -> bool:
    return True


@pytest.mark.fix
@pytest.mark.bases("0.5.3")
def test_the_message_queue_serves_on_after_hostile_messages(tmp_path, monkeypatch):
    """A registration carrying a pickle, a message of two parts and one of no known type
    reach LMCache's message-queue server; it runs nothing and answers the next ping."""
    import zmq
    from mq_server import free_url, serve

    from lmcache.utils import EngineType
    from lmcache.v1.multiprocess import custom_types
    from lmcache.v1.multiprocess.mq import MessageQueueClient
    from lmcache.v1.multiprocess.protocol import (
        RequestType,
        get_payload_classes,
        get_response_class,
    )
    from lmcache.v1.platform.base.ipc_wrapper import DeviceIPCWrapper
    from lmcache.v1.platform.cpu.shm import CpuShmTensorWrapper

    planted = tmp_path / "ran"
    registered: list[Any] = []

    def register(instance, kv_caches, model, world_size, engine, hints, infos):  # noqa: ANN001
        registered.append(kv_caches)

    names = register.__code__.co_varnames[:7]
    classes = get_payload_classes(RequestType.REGISTER_KV_CACHE)
    register.__annotations__ = {**dict(zip(names, classes, strict=True)), "return": None}
    url, ctx = free_url(), zmq.Context()
    ctx.linger = 0
    server = serve(
        url,
        ctx,
        {
            RequestType.REGISTER_KV_CACHE: register,
            RequestType.PING: answer_ping,
        },
        [RequestType.PING],
    )
    raw = ctx.socket(zmq.DEALER)
    raw.connect(url)
    client = MessageQueueClient(url, ctx)
    try:
        # The hostile client: its wrapper's wire bytes are a pickle.
        hostile = custom_types.CustomizedSerdeConfig(
            serializer=lambda obj: pickle.dumps(obj.planted),
            deserializer=DeviceIPCWrapper.Deserialize,
            code=1,
        )
        serdes = custom_types._CUSTOMERIZED_SERIALIZERS  # noqa: SLF001
        monkeypatch.setitem(serdes, DeviceIPCWrapper, hostile)
        wrapper = CpuShmTensorWrapper.__new__(CpuShmTensorWrapper)
        wrapper.planted = Planted(planted)
        client.submit_request(
            RequestType.REGISTER_KV_CACHE,
            [1, [wrapper], "m", 1, EngineType.VLLM, {}, []],
            get_response_class(RequestType.REGISTER_KV_CACHE),
        )
        time.sleep(0.5)  # the registration is handled first
        raw.send_multipart([b"only-two", b"parts"])
        raw.send_multipart([b"uid", b"\xff\xfe", b"payload"])
        ping = client.submit_request(RequestType.PING, [1], get_response_class(RequestType.PING))
        try:
            answered = ping.result(timeout=5.0)
        except Exception:  # LMCache's timeout: the server stopped answering
            answered = False
        assert not planted.exists(), "a registration's wrapper ran code"
        assert answered is True, "the server stopped answering"
        assert registered == [], "a registration carrying a pickle was accepted"
    finally:
        raw.close(linger=0)
        client.close()
        server.close()
        ctx.destroy(linger=0)
