"""A draft model for speculative decoding from a real checkpoint: the same folder with fewer
layers (its first ones, optionally also its last ones; same embeddings, final norm, LM head and
tokenizer), so its token ids are the target's and its guesses are partly right.

    python -m bench.draft_model --layers 0-5,28-29 --out /tmp/smol-8l  # from the bundled SmolLM2
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from engine.bundled import DEFAULT_DIR

LAYER = re.compile(r"^model\.layers\.(\d+)\.")
COPIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
          "chat_template.jinja", "special_tokens_map.json")  # fmt: skip


def parse_layers(spec: str) -> list[int]:
    """``"0-9,20-29"`` -> ``[0, ..., 9, 20, ..., 29]``."""
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def truncate_model(src: str | Path, dst: str | Path, keep: list[int]) -> Path:
    """Write ``dst``: ``src`` (one model.safetensors file) with only the layers ``keep`` (in
    order, renumbered from 0); embeddings, final norm, LM head and tokenizer unchanged."""
    src, dst = Path(src), Path(dst)
    cfg = json.loads((src / "config.json").read_text())
    total = cfg["num_hidden_layers"]
    if not keep or sorted(set(keep)) != keep or keep[0] < 0 or keep[-1] >= total:
        raise ValueError(f"keep must be increasing layer indices in [0, {total}), not {keep}")
    new_index = {old: new for new, old in enumerate(keep)}
    tensors = load_file(str(src / "model.safetensors"))
    kept = {}
    for name, t in tensors.items():
        m = LAYER.match(name)
        if m is None:
            kept[name] = t.contiguous()
        elif int(m.group(1)) in new_index:
            kept[f"model.layers.{new_index[int(m.group(1))]}." + name[m.end() :]] = t.contiguous()
    dst.mkdir(parents=True, exist_ok=True)
    save_file(kept, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": len(keep)}, indent=2))
    for name in COPIED:
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)
    return dst


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(DEFAULT_DIR))
    p.add_argument("--layers", default="0-5", help="layers to keep, e.g. 0-9,20-29")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    print(truncate_model(args.model, args.out, parse_layers(args.layers)))


if __name__ == "__main__":
    main()
