"""Which tier of a worker holds a published prefix, and what a hit there is worth to a router.

A worker publishes each tier as its own summary stream (``libkv.cluster.location_summary``),
under the same member lease: the device pool's prefixes under its incarnation, the host
tier's (``libkv.host_tier``) under the pseudo-incarnation ``<incarnation>~host``. The keys,
values and the routers' index are unchanged: a router's ``match`` of a prompt's chain gives
the depth of each (worker, incarnation) pair, and ``tier_depths`` reads both tiers of one
worker from it. A restarted worker has a new incarnation, so its empty host tier never
inherits its predecessor's entries (which leave etcd with the old lease).

The disk tier (``libkv.disk_tier``) is not published: a block the host tier demotes to disk
leaves the host summary, and routers score such a prefix as a miss. A disk hit is read at
NVMe speed (a few GB/s, against ~50 GB/s for a host page-in), which for an 8B model on an
H200 costs about what recomputing the block does (~0.4 ms per 2 MiB block either way): its
routing value is near zero, no reason to steer a request to a busier worker. And the tier is
many times the host tier's size: publishing it would multiply the keys in etcd and the
routers' index for little. The worker that gets the request still reads its disk hits.
"""

from __future__ import annotations

from collections.abc import Mapping

HOST = "host"
TIER_SEPARATOR = "~"  # not in incarnations (uuid hex) and not "/" (the keys' separator)

# A prompt block paged in from the host tier, valued between a device hit (1) and a miss (0).
# Estimate for an 8B model in bf16 on an H200: a 16-token block is 2 MiB, ~40 us over PCIe 5
# at ~50 GB/s, against ~0.4 ms to recompute it in a large prefill (16 tokens x 16 GFLOP at
# ~700 TFLOP/s, attention aside): ~0.1 of a miss. Page-ins also wait for the step in flight
# and are not overlapped with the prefill, so it is taken at 0.25 of a miss, not 0.1
# (bench/host_tier.py measures page-in bandwidth and TTFT to revisit it).
HOST_HIT_VALUE = 0.75


def tier_incarnation(incarnation: str, tier: str) -> str:
    """The pseudo-incarnation a worker publishes ``tier``'s prefixes under."""
    return f"{incarnation}{TIER_SEPARATOR}{tier}"


def tier_depths(
    match: Mapping[tuple[str, str], int], worker_id: str, incarnation: str
) -> tuple[int, int]:
    """(device depth, host depth) in blocks of one worker's deepest published prefixes."""
    gpu = match.get((worker_id, incarnation), 0)
    host = match.get((worker_id, tier_incarnation(incarnation, HOST)), 0)
    return gpu, host


def tier_cached_blocks(gpu: int, host: int) -> float:
    """Prompt blocks a worker holds, as routing weighs them: the device hit, plus the host
    tier's blocks past it at ``HOST_HIT_VALUE`` each (so a host hit scores between a device
    hit and a miss)."""
    return gpu + HOST_HIT_VALUE * max(host - gpu, 0)
