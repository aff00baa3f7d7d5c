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


def disk_tier_settings(docs) -> dict[str, tuple]:
    """Per worker pool: its disk-tier variables and its kv-disk volume (None: none)."""
    out = {}
    for cm in by_kind(docs, "ConfigMap"):
        data = cm.get("data") or {}
        if "TANDEM_BLOCK_SIZE" in data:
            name = cm["metadata"]["name"]
            out[name] = (data.get("TANDEM_KV_DISK_CACHE_DIR"), data.get("TANDEM_KV_DISK_CACHE_GIB"))
    for sts in by_kind(docs, "StatefulSet") + by_kind(docs, "Deployment"):
        pod = sts["spec"]["template"]["spec"]
        vol = next((v for v in pod.get("volumes") or [] if v["name"] == "kv-disk"), None)
        mounts = [m for c in pod["containers"] for m in c.get("volumeMounts") or []]
        mount = next((m["mountPath"] for m in mounts if m["name"] == "kv-disk"), None)
        if vol is not None or mount is not None:
            out[sts["metadata"]["name"] + "/volume"] = (vol, mount)
    return out


def test_the_disk_tier_is_off_unless_sized(helm) -> None:
    settings = disk_tier_settings(render(helm))
    assert settings and set(settings.values()) == {(None, None)}


def test_a_sized_disk_tier_gets_its_directory_and_volume(helm) -> None:
    docs = render(helm, sets=["prefill.engine.kvDiskCacheGib:=100",
                              "decode.engine.kvDiskCacheGib:=20.5",
                              "decode.engine.kvDiskCachePath=/mnt/nvme0/tandem"])  # fmt: skip
    settings = disk_tier_settings(docs)
    gibs = sorted(v[1] for k, v in settings.items() if not k.endswith("/volume"))
    assert gibs == ["100", "20.5"]
    assert {v[0] for k, v in settings.items() if not k.endswith("/volume")} == {
        "/var/cache/tandem-kv"
    }
    volumes = [v for k, v in settings.items() if k.endswith("/volume")]
    assert len(volumes) == 2 and all(mount == "/var/cache/tandem-kv" for _, mount in volumes)
    kinds = sorted(next(iter(k for k in vol if k != "name")) for vol, _ in volumes)
    assert kinds == ["emptyDir", "hostPath"]
    empty = next(vol for vol, _ in volumes if "emptyDir" in vol)
    assert empty["emptyDir"]["sizeLimit"] == "101Gi"
