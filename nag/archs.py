"""
The architectures base_train can train, by name: the one place that knows both nanochat/ and nag/.

A model class plugs in through the hooks GPT defines (add_args, init_kwargs_from_args,
optimizer_kwargs_from_args, optimizer_groups, set_tokens_seen, after_optimizer_step,
telemetry, step_metrics, extra_meta / extra_init_kwargs); base_train calls only those, so a new arch
is a subclass plus one line here.
"""

from nanochat.common import UserError
from nanochat.gpt import GPT
from nanochat import checkpoint_manager as ckpt
from nag.model import NAGGPT
from nag.router_mod import RouterMoDGPT

ARCHS = {"gpt": GPT, "nag": NAGGPT}
# variants picked by a flag on top of --arch; their checkpoints record the variant's name
VARIANTS = {"gpt-router": RouterMoDGPT}  # --arch gpt --mod-router: the router-MoD baseline (paper eq. 40)


def model_class(arch):
    if arch in ARCHS:
        return ARCHS[arch]
    if arch in VARIANTS:
        return VARIANTS[arch]
    raise UserError(f"unknown arch {arch!r} (expected one of: {', '.join(ARCHS)})")


def arch_for_args(args):
    """(arch name, model class) that the flags ask for: --arch, turned into its router-MoD variant by --mod-router."""
    cls = model_class(args.arch)
    if getattr(args, "mod_router", False):
        if cls is NAGGPT:
            raise UserError("--mod-router is the GPT baseline's MoD (paper eq. 40); NAG skips by its rotation score: "
                            "drop --mod-router, or use --arch gpt")
        if cls is not GPT and cls is not RouterMoDGPT:
            raise UserError(f"--mod-router applies to --arch gpt only (got --arch {args.arch})")
        return RouterMoDGPT.arch, RouterMoDGPT
    if cls is GPT and (getattr(args, "mod_rate", None) is not None or getattr(args, "mod_blocks", None)):
        raise UserError("the GPT baseline has no score to skip tokens by: add --mod-router for the router-MoD baseline, "
                        "or use --arch nag")
    return args.arch, cls


def load_model(run_dir, step=None, device="cpu"):
    """(model, meta) of a run's latest (or given) complete checkpoint, in eval mode."""
    return ckpt.load_model(run_dir, step, device, model_class)
