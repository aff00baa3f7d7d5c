"""A router serving several base models: each model's core sees only its own workers, and a
request's model names a base model or an adapter some worker of one holds."""

from __future__ import annotations

import dataclasses

import pytest

from engine.bundled import DEFAULT_DIR
from engine.errors import AdapterNotFoundError, InvalidRequestError
from engine.tokenizer import Tokenizer
from libkv.cluster.registry import LORAS, Member, ModelDirectory
from services.router.core import RouterCore
from services.router.server import RouterServicer
from tests.services.test_router_policy import Directory


def worker(worker_id: str, role: str, model: str, *loras: str) -> Member:
    m = Member(worker_id, role, model, f"{worker_id}:1", 100, 16, f"inc-{worker_id}")
    return dataclasses.replace(m, extra={LORAS: ",".join(loras)})


MEMBERS = [
    worker("p0", "prefill", "smol"), worker("d0", "decode", "smol", "sql"),
    worker("p1", "prefill", "tiny"), worker("d1", "decode", "tiny", "tiny/chat"),
]  # fmt: skip


@pytest.fixture(scope="module")
def servicer() -> RouterServicer:
    d = Directory(MEMBERS)
    tok = Tokenizer(DEFAULT_DIR)
    routes = {
        name: (RouterCore(ModelDirectory(d, name), clients=None), tok) for name in ("smol", "tiny")
    }
    return RouterServicer(routes, frozenset())


def test_each_model_sees_only_its_workers():
    d = ModelDirectory(Directory(MEMBERS), "tiny")
    assert [m.worker_id for m in d.members_by_role("decode")] == ["d1"]
    assert [m.worker_id for m in d.members_by_role("prefill")] == ["p1"]


def test_models_and_adapters_resolve_to_their_base(servicer):
    assert servicer._resolve("") == ("smol", "")  # no model: the first
    assert servicer._resolve("tiny") == ("tiny", "")
    assert servicer._resolve("sql") == ("smol", "sql")
    assert servicer._resolve("tiny/chat") == ("tiny", "tiny/chat")
    with pytest.raises(AdapterNotFoundError, match="`nope` does not exist"):
        servicer._resolve("nope")
    # With two base models an adapter load names its base.
    assert servicer._base("tiny/fr") == "tiny"
    with pytest.raises(InvalidRequestError, match="BASE/NAME"):
        servicer._base("fr")


class Records:
    """In-memory stand-in for the etcd adapter records (``libkv.cluster.adapters``)."""

    def __init__(self) -> None:
        self.data: dict[tuple[str, str], str] = {}
        self.log: list[tuple[str, str]] = []

    async def put(self, model: str, name: str, path: str) -> None:
        self.log.append(("put", name))
        self.data[(model, name)] = path

    async def delete(self, model: str, name: str) -> None:
        self.log.append(("delete", name))
        self.data.pop((model, name), None)

    async def list(self, model: str) -> dict[str, str]:
        return {n: p for (m, n), p in self.data.items() if m == model}


class AdapterClients:
    """Workers whose decode worker refuses every folder."""

    def __init__(self) -> None:
        self.unloaded: list[str] = []

    async def load_lora(self, worker: Member, name: str, path: str) -> None:
        if worker.role == "decode":
            raise InvalidRequestError("bad folder")

    async def unload_lora(self, worker: Member, name: str) -> None:
        self.unloaded.append(worker.worker_id)


async def test_adapter_records_follow_loads_and_unloads():
    """A load is recorded before the workers are asked and forgotten when one refuses it (the
    others unload it again); an unload forgets a record even when no live worker holds it."""
    records, clients = Records(), AdapterClients()
    core = RouterCore(ModelDirectory(Directory(MEMBERS), "tiny"), clients, records=records,
                      model="tiny")  # type: ignore[arg-type]  # fmt: skip
    with pytest.raises(InvalidRequestError, match="bad folder"):
        await core.load_lora("tiny/x", "/adapters/x")
    assert records.log == [("put", "tiny/x"), ("delete", "tiny/x")] and records.data == {}
    assert clients.unloaded == ["p1"]
    records.data[("tiny", "tiny/old")] = "/adapters/old"  # loaded while no worker was live
    assert await core.unload_lora("tiny/old") == []
    assert records.data == {}
    with pytest.raises(AdapterNotFoundError):
        await core.unload_lora("tiny/none")
