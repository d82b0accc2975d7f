"""
The architectures base_train can train, by name: the one place that knows both nanochat/ and nag/.

An arch is a model class (a GPT subclass: its runtime hooks are optimizer_groups, set_tokens_seen,
after_optimizer_step, step_metrics, nonfinite_origin, extra_meta / extra_init_kwargs) plus an ArchSpec:
the functions it brings to the command line (its flags, the constructor and optimizer arguments read from
them, its telemetry). A new arch is a subclass plus one entry in ARCHS; base_train never names an arch.
"""

from dataclasses import dataclass, field

from nanochat.common import UserError
from nanochat.gpt import GPT
from nanochat import checkpoint_manager as ckpt
from nanochat import plan as run_plan
from nanochat.resume import NOT_SETTINGS as BASELINE_NOT_SETTINGS
from nag.model import NAGGPT, add_nag_args, nag_config_from_args
from nag.mod import add_mod_args, mod_config_from_args
from nag.router_mod import RouterMoDGPT
from nanochat.recipe import PARTS as RECIPE_PARTS, RecipeGPT, RecipeParts, add_recipe_args, recipe_config_from_args
from nag.recipe import NAGRecipeGPT


def no_flags(parser):
    pass


def no_kwargs(args):
    return {}


def no_telemetry(model, step, idx, args):
    return None, None


@dataclass(frozen=True)
class ArchSpec:
    """What an arch brings to base_train beyond its model class (torchtitan's ModelSpec is the model)."""
    model_class: type
    add_args: callable = no_flags  # its own flags (an arch sharing another's flags leaves this out)
    init_kwargs: callable = no_kwargs  # constructor arguments beyond the GPTConfig, from parsed flags (may raise UserError)
    optimizer_kwargs: callable = no_kwargs  # extra keyword arguments of model.optimizer_groups, from parsed flags
    telemetry: callable = no_telemetry  # (model, step, idx, args) -> (dict for metrics.jsonl or None, line to print or None)
    reads: frozenset = field(default_factory=frozenset)  # flags of other archs it reads too
    not_settings: frozenset = field(default_factory=frozenset)  # its flags that change no number it trains


def add_nag_and_mod_args(parser):
    add_nag_args(parser)
    add_mod_args(parser)  # read by the router-MoD variant too


def nag_init_kwargs(args):
    return {"nag": nag_config_from_args(args), "impl": args.nag_impl or None, "mod": mod_config_from_args(args)}


def nag_telemetry(model, step, idx, args):
    every = args.nag_gate_log_every
    if every <= 0 or step % every:
        return None, None
    t = model.gate_telemetry(idx)  # one extra no-grad forward on the last micro-batch
    return t, model.format_telemetry(t)


def recipe_init_kwargs(args):
    return {"recipe": recipe_config_from_args(args)}


def nag_recipe_init_kwargs(args):
    return {"nag": nag_config_from_args(args), "impl": args.nag_impl or None, "recipe": recipe_config_from_args(args)}


def router_init_kwargs(args):
    mod = mod_config_from_args(args)
    if mod is None:
        raise UserError("the router-MoD baseline needs --mod-rate (the target share of skipped token-sublayers)")
    return {"mod": mod}


ARCHS = {
    "gpt": ArchSpec(GPT),
    "nag": ArchSpec(NAGGPT, add_args=add_nag_and_mod_args, init_kwargs=nag_init_kwargs,
                    optimizer_kwargs=lambda args: {"gate_lr": args.nag_gate_lr, "temp_gain_lr": args.nag_temp_gain_lr},
                    telemetry=nag_telemetry, not_settings=frozenset({"nag_gate_log_every", "nag_impl"})),
    # today's nanochat recipe (nanochat/recipe.py, docs/design.md §10): the baseline with nanochat's record-run parts,
    # and NAG with the same parts carried over or adapted (nag/recipe.py); NAG-on-recipe reads the NAG and recipe flags
    "gpt-recipe": ArchSpec(RecipeGPT, add_args=add_recipe_args, init_kwargs=recipe_init_kwargs,
                           optimizer_kwargs=lambda args: {"scalar_lr": args.scalar_lr}),
    "nag-recipe": ArchSpec(NAGRecipeGPT, init_kwargs=nag_recipe_init_kwargs,
                           optimizer_kwargs=lambda args: {"gate_lr": args.nag_gate_lr, "temp_gain_lr": args.nag_temp_gain_lr,
                                                          "scalar_lr": args.scalar_lr},
                           telemetry=nag_telemetry),
}
# variants picked by a flag on top of --arch; their checkpoints record the variant's name
VARIANTS = {
    # --arch gpt --mod-router: the router-MoD baseline (paper eq. 40). Its --mod-* flags are NAG's (registered
    # once, by the nag spec), and --nag-gate-lr sets its routers' LR, as the gates' LR of its NAG twin
    "gpt-router": ArchSpec(RouterMoDGPT, init_kwargs=router_init_kwargs,
                           optimizer_kwargs=lambda args: {"router_lr": args.nag_gate_lr}, reads=frozenset({"nag_gate_lr"})),
}

# every flag of every arch that changes no number a run trains (nanochat/resume.py says what that list is for)
NOT_SETTINGS = BASELINE_NOT_SETTINGS | frozenset().union(*(s.not_settings for s in {**ARCHS, **VARIANTS}.values()))


def arch_spec(arch):
    if arch in ARCHS:
        return ARCHS[arch]
    if arch in VARIANTS:
        return VARIANTS[arch]
    raise UserError(f"unknown arch {arch!r} (expected one of: {', '.join(ARCHS)})")


def is_nag_arch(arch):
    """Whether an arch name is a NAG model (it reads the --nag-* flags and a preset's NAG flags)."""
    spec = ARCHS.get(arch) or VARIANTS.get(arch)
    return spec is not None and issubclass(spec.model_class, NAGGPT)


def model_class(arch):
    return arch_spec(arch).model_class


def add_arch_args(parser):
    """Every arch's own flags (each registered once, whatever arch the command line picks)."""
    for add_args in dict.fromkeys(s.add_args for s in ARCHS.values()):
        add_args(parser)


def arch_for_args(args):
    """(arch name, ArchSpec) that the flags ask for: --arch, turned into its router-MoD variant by --mod-router."""
    spec = arch_spec(args.arch)
    mod_asked = getattr(args, "mod_rate", None) is not None or getattr(args, "mod_blocks", None)
    if issubclass(spec.model_class, (RecipeGPT, NAGRecipeGPT)) and (mod_asked or getattr(args, "mod_router", False)):
        raise UserError(f"--arch {args.arch} has no Mixture-of-Depths: drop the --mod-* flags, or use --arch gpt / nag")
    if getattr(args, "mod_router", False):
        if spec.model_class is NAGGPT:
            raise UserError("--mod-router is the GPT baseline's MoD (paper eq. 40); NAG skips by its rotation score: "
                            "drop --mod-router, or use --arch gpt")
        if spec.model_class not in (GPT, RouterMoDGPT):
            raise UserError(f"--mod-router applies to --arch gpt only (got --arch {args.arch})")
        return RouterMoDGPT.arch, VARIANTS[RouterMoDGPT.arch]
    if spec.model_class is GPT and mod_asked:
        raise UserError("the GPT baseline has no score to skip tokens by: add --mod-router for the router-MoD baseline, "
                        "or use --arch nag")
    return args.arch, spec


RECIPE_FLAGS = frozenset({f"no_{part}" for part in RECIPE_PARTS} | {"scalar_lr"})


def unread_flags(args):
    """{flag key: family} of every NAG or recipe flag the arch of args does not read, whatever its value: no setting
    of that run. Its value is recorded in config.json's args as given, but a resume never compares it (base_train adds
    these to the not-settings), so --no-smear or --scalar-lr given to, or dropped from, a gpt run never blocks it."""
    arch, spec = arch_for_args(args)
    reads = {"nag": issubclass(spec.model_class, NAGGPT), "recipe": issubclass(spec.model_class, RecipeParts)}
    out = {}
    for k in vars(args):
        family = "nag" if k.startswith("nag_") else "recipe" if k in RECIPE_FLAGS else None
        if family and not reads[family] and k not in spec.reads:
            out[k] = family
    return out


def ignored_flags(args, defaults):
    """{family: flags} of the NAG or recipe flags set on an arch that does not read them (defaults: the parser's
    defaults). Not an error: speedrun.sh passes one flag list to both runs of a pair; but never silent either."""
    out = {}
    for k, family in unread_flags(args).items():
        if getattr(args, k) != getattr(defaults, k):
            out.setdefault(family, []).append(f"--{k.replace('_', '-')}")
    return out


def check_args(args):
    """base_train's flags checked (nanochat/plan.py) and its arch picked: one line for the first problem."""
    run_plan.check_args(args)
    return arch_for_args(args)


def plan_for(args, vocab_size, nproc):
    """The Plan (nanochat/plan.py) of a run's flags: its arch's model built on the meta device, batch, horizon, LRs."""
    arch, spec = check_args(args)
    return run_plan.make_plan(args, vocab_size, nproc, arch, spec.model_class, spec.init_kwargs(args), spec.optimizer_kwargs(args))


def load_model(run_dir, step=None, device="cpu"):
    """(model, meta) of a run's latest (or given) complete checkpoint, in eval mode."""
    return ckpt.load_model(run_dir, step, device, model_class)
