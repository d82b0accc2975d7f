"""
The architectures base_train can train, by name: the one place that knows both nanochat/ and nag/.

A model class plugs in through the hooks GPT defines (add_args, init_kwargs_from_args,
optimizer_kwargs_from_args, optimizer_groups, set_tokens_seen, after_optimizer_step,
telemetry, extra_meta / extra_init_kwargs); base_train calls only those, so a new arch
is a subclass plus one line here.
"""

from nanochat.common import UserError
from nanochat.gpt import GPT
from nanochat import checkpoint_manager as ckpt
from nag.model import NAGGPT

ARCHS = {"gpt": GPT, "nag": NAGGPT}


def model_class(arch):
    if arch not in ARCHS:
        raise UserError(f"unknown arch {arch!r} (expected one of: {', '.join(ARCHS)})")
    return ARCHS[arch]


def load_model(run_dir, step=None, device="cpu"):
    """(model, meta) of a run's latest (or given) complete checkpoint, in eval mode."""
    return ckpt.load_model(run_dir, step, device, model_class)
