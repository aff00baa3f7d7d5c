"""How many blocks the KV tiers below the device pool get (``engine.host_store``)."""

from __future__ import annotations

import os

import torch

GIB = 1024**3
# Auto size on CUDA hosts: this share of the host's available memory, split over its GPUs,
# and at most HOST_POOL_RATIO x the device pool (SGLang's --hicache-ratio default is 2).
HOST_MEMORY_SHARE = 0.3
HOST_POOL_RATIO = 2.0


def host_slots(
    host_gib: float | None, block_bytes: int, device: torch.device, device_pool_bytes: int
) -> int:
    """Host blocks of ``block_bytes`` (a canonical block: every KV head) for ``host_gib``
    GiB; None means auto: 0 on CPU hosts, on CUDA hosts ``min(HOST_POOL_RATIO x the device
    pool, HOST_MEMORY_SHARE x available memory / GPUs)``."""
    if host_gib is None:
        if device.type != "cuda":
            return 0
        share = HOST_MEMORY_SHARE * _available_memory() / max(torch.cuda.device_count(), 1)
        nbytes = min(HOST_POOL_RATIO * device_pool_bytes, share)
    else:
        nbytes = host_gib * GIB
    return max(int(nbytes // block_bytes), 0)


def _available_memory() -> int:
    """Memory this process may still take (bytes): the host's MemAvailable, capped by the
    cgroup's limit less its use (a container's /proc/meminfo shows the whole host's)."""
    available = _meminfo_available()
    limit = _cgroup_room()
    return min(available, limit) if limit is not None else available


def _meminfo_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


CGROUP_FILES = (  # (limit, usage): cgroup v2, then v1
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
)


def _cgroup_room(files: tuple[tuple[str, str], ...] = CGROUP_FILES) -> int | None:
    """The cgroup's memory limit less its usage, or None without a limit."""
    for limit_path, usage_path in files:
        try:
            with open(limit_path) as f:
                limit = f.read().strip()
            with open(usage_path) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or int(limit) >= 1 << 60:  # v1 writes a huge number for none
            return None
        return max(int(limit) - usage, 0)
    return None
