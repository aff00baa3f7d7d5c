"""Tensor parallelism inside one engine: the model split over N ranks, one process per device.

- ``shard``: which heads, MLP rows and vocabulary rows each rank holds (no torch);
- ``comm``: the model's collectives (all-reduce, vocab gather) over ``torch.distributed``;
- ``ranks``: rank 0 (the engine's process) spawns ranks 1..N-1, sends them every step,
  watches them, and calls into them (``rpc``);
- ``worker``: the main of ranks 1..N-1.
"""
