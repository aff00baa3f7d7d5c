"""Runs on a bare GPU host (PyTorch, Triton, transformers only): ``prepare`` packs what it
lacks, ``run.sh`` installs it there and runs a named job. See README "Serving on GPUs"."""
