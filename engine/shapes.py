"""Model folders of real model shapes, for serving and benchmarking without downloads.

    python -m engine.shapes llama-3.1-8b --out /tmp/llama-8b
    tandem serve --model /tmp/llama-8b --load-format dummy --gpus 0

A folder holds the model's published ``config.json`` and the bundled SmolLM2 tokenizer and
chat template (so prompts tokenize and chats render), but no weights: serve it with
``--load-format dummy``, which fills every weight with seeded random values of the right shape
(identical in every worker with the same seed). Outputs are meaningless text; speed, memory
and KV-transfer sizes are those of the real model.

The folder is self-consistent: its tokenizer has exactly ``vocab_size`` ids, as the published
model's does, so the embedding and LM head keep the published size (Llama-3.1-8B: 128,256 x
4,096 in bf16, 1.05 GB each) and any server reading the folder (Tandem, vLLM) builds the same
model from the same config, with no override. The bundled tokenizer's 49,152 ids are kept as
they are (every text encodes to the same ids); ``pad_vocab`` fills the ids above them with
tokens that each decode to text (two of its word tokens joined: " sun day"), which no merge
rule produces, so a sampled id always streams text. The folder's BOS/EOS ids are the
tokenizer's, so that grammars and stop conditions refer to real tokens.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from engine.bundled import DEFAULT_DIR

_LLAMA3_ROPE = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}

# The published config.json of each model, as far as the engine reads it.
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {"factor": 8.0, **_LLAMA3_ROPE},
        "tie_word_embeddings": False,
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
        "torch_dtype": "bfloat16",
    },
    "llama-3.2-3b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 28,
        "num_attention_heads": 24,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {"factor": 32.0, **_LLAMA3_ROPE},
        "tie_word_embeddings": True,
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
        "torch_dtype": "bfloat16",
    },
    "llama-3.2-1b": {  # the usual draft for the Llama-3.1-8B shape
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "hidden_act": "silu",
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {"factor": 32.0, **_LLAMA3_ROPE},
        "tie_word_embeddings": True,
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
        "torch_dtype": "bfloat16",
    },
    "qwen2.5-7b": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
    },
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "hidden_act": "silu",
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    },
}
# What a folder takes from the tokenizer's folder (tokenizer.json padded, see pad_vocab).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def write_shape(name: str, out: Path, tokenizer_dir: Path = DEFAULT_DIR) -> Path:
    """Write the folder of shape ``name`` (config.json plus the tokenizer of
    ``tokenizer_dir``, padded to the config's ``vocab_size``) to ``out``; returns ``out``."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; one of {', '.join(SHAPES)}")
    missing = [f for f in TOKENIZER_FILES if not (tokenizer_dir / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{tokenizer_dir} lacks {', '.join(missing)}: pass --tokenizer DIR (a folder with "
            "tokenizer.json and tokenizer_config.json), or run `make model` for the bundled one"
        )
    spec = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    padded = pad_vocab(spec, SHAPES[name]["vocab_size"])
    out.mkdir(parents=True, exist_ok=True)
    config = {**SHAPES[name], **_special_ids(tokenizer_dir)}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    text = json.dumps(padded, ensure_ascii=False)
    (out / "tokenizer.json").write_text(text, encoding="utf-8")
    shutil.copyfile(tokenizer_dir / "tokenizer_config.json", out / "tokenizer_config.json")
    return out


def tokenizer_size(spec: dict) -> int:
    """Ids of a ``tokenizer.json``: its highest id (vocabulary or added tokens) plus one."""
    vocab = spec["model"]["vocab"]
    ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
    ids += [t["id"] for t in spec.get("added_tokens", [])]
    return max(ids) + 1


def pad_vocab(spec: dict, vocab_size: int) -> dict:
    """``spec`` (a BPE ``tokenizer.json``) with ids up to ``vocab_size`` (a copy; ``spec``
    itself when it has them all already).

    Each new id is a vocabulary entry of two of the tokenizer's own word tokens joined
    (``"Ġsun" + "Ġday"``, byte-level; ``"▁sun▁day"``, SentencePiece), so it decodes to text
    (" sun day"). BPE only ever produces a token by a merge rule, and no rule makes these (an
    entry already in the vocabulary is never reused), so every text encodes to the same ids as
    before: the tokenizer is the same one, with more ids it can decode.
    """
    have = tokenizer_size(spec)
    if have > vocab_size:
        raise ValueError(f"the tokenizer has {have} ids, more than vocab_size {vocab_size}")
    if have == vocab_size:
        return spec
    model = spec["model"]
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise ValueError("only a BPE tokenizer.json can be padded to the shape's vocab_size")
    vocab = dict(model["vocab"])
    # Word tokens: a space marker and ASCII letters, in id order (the most frequent first).
    words = sorted(
        (i, t) for t, i in vocab.items() if t[:1] in "Ġ▁" and len(t) > 2 and _letters(t[1:])
    )
    w = len(words)
    k, next_id = 0, have
    while next_id < vocab_size:
        # k -> (k mod w, (k mod w + 1 + k div w) mod w): distinct pairs, no word twice in a row,
        # while k < w * (w - 1)
        if k >= w * (w - 1):
            raise ValueError(f"{w} word tokens are too few to pad to {vocab_size} ids")
        i = k % w
        token = words[i][1] + words[(i + 1 + k // w) % w][1]
        k += 1
        if token not in vocab:
            vocab[token] = next_id
            next_id += 1
    return {**spec, "model": {**model, "vocab": vocab}}


def _letters(text: str) -> bool:
    return text.isascii() and text.isalpha()


def _special_ids(tokenizer_dir: Path) -> dict[str, int]:
    """``bos_token_id`` / ``eos_token_id`` of the tokenizer's BOS and EOS tokens."""
    from tokenizers import Tokenizer

    cfg = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    out = {}
    for key in ("bos", "eos"):
        token = cfg.get(f"{key}_token")
        token = token.get("content") if isinstance(token, dict) else token
        token_id = tok.token_to_id(token) if token else None
        if token_id is not None:
            out[f"{key}_token_id"] = token_id
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.shapes", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("--out", type=Path, required=True, help="folder to write")
    p.add_argument("--tokenizer", type=Path, default=DEFAULT_DIR, help="tokenizer folder")
    args = p.parse_args(argv)
    print(write_shape(args.shape, args.out, args.tokenizer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
