"""Experiment drivers: each runs several commands' work through their public entries.

The entries are train, evaluate and main. Shared here: the CPU data and tokenizer that the tiny drivers need first.
"""

import os

from nanochat.dataset import build_offline_corpus, list_parquet_files
from nanochat.tokenizer import has_tokenizer, train_tokenizer
from nag.presets import get_preset

CPU_TOKENIZER_CHARS = 20_000_000  # runs/runcpu.sh's tokenizer: its vocab is the demo preset's


def prepare_cpu_data(base):
    """What runs/runcpu.sh builds first, for drivers that run tiny models: the offline corpus and the demo's
    tokenizer (4,096 tokens), each unless the base dir already has one."""
    if not list_parquet_files(os.path.join(base, "base_data")):
        build_offline_corpus(data_dir=os.path.join(base, "base_data"))
    if not has_tokenizer(base):
        train_tokenizer(get_preset("demo")["vocab"], CPU_TOKENIZER_CHARS)
