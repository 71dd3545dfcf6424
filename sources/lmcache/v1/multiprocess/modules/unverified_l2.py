# SPDX-License-Identifier: Apache-2.0
"""Hybrid layouts are refused on an L2 tier whose adapters cannot verify an object.

An adapter listed here keeps objects on persistent storage that others can write to (a
file system, a block device) and loads whatever bytes it finds under a key, with nothing
a load can check: an object torn by a failed store or a crash, or replaced on disk, is
served as KV. A dense model's KV keeps pristine behaviour there; a layout keyed in a
layout namespace (a hybrid model) registered with a server whose L2 adapters include one
is refused like an undeclared client: the server logs one error naming the adapter and
the ``fs`` adapter that verifies its objects, stores nothing for the model and keys its
lookups where nothing is stored. The engine keeps serving without the cache.

Not listed: ``fs`` (whole-object publish, keyed tag), ``resp`` (keyed tag on every
value), the in-memory or process-local ones (``mock``, ``p2p``, ``dax``, ``nixl_store``:
only objects this server stored and saw complete are indexed, none survive it), the
stores whose protocol publishes an object whole (``s3``, ``hfbucket``, ``bigtable``,
``aerospike``, ``valkey``, ``mooncake_store``, ``sagemaker-hyperpod``), and the plugins
(``plugin``, ``native_plugin``: code of the operator's own, judged by them).
``fault_inject`` is judged by the adapter it wraps.
"""

# Future
from __future__ import annotations

# Standard
from typing import Any

# First Party
from lmcache.v1.distributed.l2_adapters.config import get_type_name_for_config

# L2 adapter types whose objects a load cannot verify.
UNVERIFIED_L2_ADAPTERS = frozenset(
    {
        # C++ disk connector: files at deterministic names, found again after a restart.
        "fs_native",
        # Files renamed into place without fsync; files found on disk are served.
        "nixl_store_dynamic",
        # Header and payload written apart; the slot header names the key, not the
        # bytes.
        "raw_block",
        # C++ 3FS connector (LMCache 0.5.6): files on a shared 3FS mount, found by a
        # scan.
        "hf3fs",
        # C++ NIXL connector (LMCache 0.5.6): FILE or OBJ storage through a NIXL plugin.
        "nixl_native",
    }
)


def _unverified(config: Any) -> str | None:
    try:
        name = get_type_name_for_config(config)
    except ValueError:  # not a registered adapter type
        return None
    if name in UNVERIFIED_L2_ADAPTERS:
        return name
    inner = getattr(config, "inner_config", None)
    if name == "fault_inject" and inner is not None:  # judged by what it wraps
        wrapped = _unverified(inner)
        return None if wrapped is None else f"fault_inject({wrapped})"
    return None


def unverified_l2_adapters(storage_manager: Any) -> list[str]:
    """The types of the server's active L2 adapters whose objects a load cannot
    verify."""
    adapters = getattr(storage_manager, "l2_adapters", None)
    if adapters is None:
        return []
    found = (_unverified(desc.config) for desc, _adapter in adapters())
    return [name for name in found if name is not None]
