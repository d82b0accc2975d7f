"""Experiment drivers: each runs several commands' work through their public entries.

The entries are train, evaluate and main."""

import os

from nanochat.dataset import build_offline_corpus, list_parquet_files
from scripts import tok_train


def prepare_cpu_data(base):
    """What runs/runcpu.sh builds first, for drivers that run tiny models: the offline corpus and the demo's
    tokenizer (4,096 tokens), each unless the base dir already has one."""
    if not list_parquet_files(os.path.join(base, "base_data")):
        build_offline_corpus(data_dir=os.path.join(base, "base_data"))
    if not os.path.exists(os.path.join(base, "tokenizer", "tokenizer.pkl")):
        tok_train.main(["--vocab-size", "4096", "--max-chars", "20000000"])
