"""What the connector reads from LMCache's adapters, the real adapters define (both bases).

The connector's tests stand the scheduler adapter in with a fake; an attribute the fake has
and the real adapter never sets passes every such test and stops every engine at start.
Revision 6 of the 0.5.6 base read one (``experimental``) from the scheduler adapter: on a GPU
no engine started. Here the connector module's own source is read for every
``self.scheduler_adapter.<name>`` and ``self.worker_adapter.<name>``, and each name must be
defined by the real class: a class attribute, method or property, or assigned to ``self`` in
one of its methods.
"""

from __future__ import annotations

import ast
import inspect

import pytest

pytest.importorskip("vllm")
pytest.importorskip("lmcache")

pytestmark = pytest.mark.bases("0.5.3", "0.5.6")


def read_from(module: object, owner: str) -> set[str]:
    """Attribute names the module reads or calls on ``self.<owner>``."""
    names = set()
    for node in ast.walk(ast.parse(inspect.getsource(module))):  # type: ignore[arg-type]
        value = getattr(node, "value", None)
        if (
            isinstance(node, ast.Attribute)
            and isinstance(value, ast.Attribute)
            and value.attr == owner
            and isinstance(value.value, ast.Name)
            and value.value.id == "self"
        ):
            names.add(node.attr)
    return names


def defined_by(cls: type) -> set[str]:
    """Names the class defines: its (inherited) members and what its methods assign to
    ``self``."""
    names = set(dir(cls))
    for klass in cls.__mro__[:-1]:
        for node in ast.walk(ast.parse(inspect.getsource(klass))):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign | ast.AugAssign)
                else []
            )
            for target in targets:
                if (
                    isinstance(target, ast.Attribute)
                    and isinstance(target.value, ast.Name)
                    and target.value.id == "self"
                ):
                    names.add(target.attr)
    return names


@pytest.mark.parametrize(
    "owner, adapter",
    [
        ("scheduler_adapter", "LMCacheMPSchedulerAdapter"),
        ("worker_adapter", "LMCacheMPWorkerAdapter"),
    ],
)
def test_the_connector_reads_only_what_the_real_adapter_defines(owner, adapter):
    from lmcache.integration.vllm import lmcache_mp_connector as connector
    from lmcache.integration.vllm import vllm_multi_process_adapter as adapters

    reads = read_from(connector, owner)
    assert reads, f"the connector reads nothing from self.{owner}: the scan found no reads"
    missing = reads - defined_by(getattr(adapters, adapter))
    assert not missing, f"the connector reads {sorted(missing)} that {adapter} never defines"
