"""The chart's `engine.kvHostCacheGib`: unset, the workers size their host KV tier themselves
(no variable); set, each pool's config carries it, 0 (off) included."""

from __future__ import annotations

import pytest

from tests.helm_render import by_kind, find_helm, render


@pytest.fixture(scope="module")
def helm() -> str:
    return find_helm()


def host_tier_settings(docs) -> dict[str, str | None]:
    out = {}
    for cm in by_kind(docs, "ConfigMap"):
        data = cm.get("data") or {}
        if "TANDEM_BLOCK_SIZE" in data:  # a worker pool's config
            out[cm["metadata"]["name"]] = data.get("TANDEM_KV_HOST_CACHE_GIB")
    return out


def test_unset_leaves_the_workers_default(helm) -> None:
    settings = host_tier_settings(render(helm))
    assert settings and set(settings.values()) == {None}


def test_each_pool_passes_its_own_size_zero_included(helm) -> None:
    docs = render(helm, sets=["prefill.engine.kvHostCacheGib:=12.5",
                              "decode.engine.kvHostCacheGib:=0"])  # fmt: skip
    settings = host_tier_settings(docs)
    assert sorted(v for v in settings.values() if v is not None) == ["0", "12.5"]
