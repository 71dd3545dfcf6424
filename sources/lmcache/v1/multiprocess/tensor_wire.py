# SPDX-License-Identifier: Apache-2.0
"""Tensors on the message queue as data only.

The engine-driven transfer without shared memory (LMCache's "pickle" transport) sent
KV chunks as pickles, and the server unpickled what any client of its message queue
sent: whoever could connect to the port ran code as the server's user. Here each chunk
travels as its dtype's name, its shape and its bytes (MessagePack). Decoding builds CPU
tensors from the bytes alone, for the dtypes torch names, and refuses a payload whose
bytes do not fill its shape exactly.
"""

# Future
from __future__ import annotations

# Standard
from typing import Annotated
import math

# Third Party
import msgspec
import torch

DTYPES = {
    str(value).removeprefix("torch."): value
    for value in vars(torch).values()
    if isinstance(value, torch.dtype)
}
"""The dtypes a chunk may have, by name."""


class _Chunk(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    dtype: str
    shape: tuple[Annotated[int, msgspec.Meta(ge=0)], ...]
    data: bytes


def encode_tensors(tensors: list[torch.Tensor]) -> bytes:
    """The tensors' dtypes, shapes and bytes, as MessagePack."""
    chunks = []
    for t in tensors:
        flat = t.detach().to("cpu").contiguous().reshape(-1)
        raw = (
            flat.view(torch.uint8)
            if flat.numel()
            else torch.empty(0, dtype=torch.uint8)
        )
        chunks.append(
            _Chunk(
                str(t.dtype).removeprefix("torch."),
                tuple(t.shape),
                raw.numpy().tobytes(),
            )
        )
    return msgspec.msgpack.encode(chunks)


def decode_tensors(data: bytes) -> list[torch.Tensor]:
    """CPU tensors from :func:`encode_tensors`' bytes.

    Raises:
        ValueError: the payload is not a list of chunks of a known dtype whose
            bytes fill their shape (msgspec's errors are ValueErrors too).
    """
    tensors = []
    for chunk in msgspec.msgpack.decode(data, type=list[_Chunk]):
        dtype = DTYPES.get(chunk.dtype)
        if dtype is None:
            raise ValueError(f"unknown tensor dtype {chunk.dtype[:40]!r}")
        if math.prod(chunk.shape) * dtype.itemsize != len(chunk.data):
            raise ValueError(
                f"{len(chunk.data)} bytes do not fill a {chunk.dtype} {chunk.shape}"
            )
        if not chunk.data:
            tensors.append(torch.empty(chunk.shape, dtype=dtype))
            continue
        raw = torch.frombuffer(bytearray(chunk.data), dtype=torch.uint8)
        tensors.append(raw.view(dtype).reshape(chunk.shape))
    return tensors
