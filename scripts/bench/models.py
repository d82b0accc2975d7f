"""
The benchmarks' shared library (not a command): the randomly initialised models they time.

Every benchmark seeds and builds its model here, so that the same flags give the same weights in each (seed 0,
then the class's own initialised()). What a benchmark does to the weights afterwards (noise, MoD calibration)
is its own.
"""

import torch

from nanochat.gpt import GPTConfig
from nag.archs import model_class


def build(cls, config, device="cpu", **kwargs):
    """cls(config, **kwargs) with random weights on device: torch.manual_seed(0), then init_weights."""
    torch.manual_seed(0)
    return cls.initialised(config, device, **kwargs)


def shape_config(args):
    """The GPTConfig of a benchmark's shape flags (--depth, --model-dim, --head-dim, --max-seq-len, --vocab-size)."""
    heads = args.model_dim // args.head_dim
    return GPTConfig(
        sequence_len=args.max_seq_len,
        vocab_size=args.vocab_size,
        n_layer=args.depth,
        n_head=heads,
        n_kv_head=heads,
        n_embd=args.model_dim,
    )


def train_config(train_argv, vocab_size):
    """The GPTConfig that base_train's flags in train_argv give (its defaults fill in the rest)."""
    from nanochat.plan import model_config_from_args
    from nag.train_flags import parse_args  # here: the benchmarks that take no base_train flags load none of it

    return model_config_from_args(parse_args(train_argv), vocab_size)


def variant(name, config, device):
    """bench_train's variant gpt, nag or nag:IMPL (the implementation of NAG's update) as a built model."""
    arch, _, impl = name.partition(":")
    return build(model_class(arch), config, device, **({"impl": impl} if impl else {}))
