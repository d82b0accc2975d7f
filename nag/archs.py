"""
The architectures base_train can train, by name: the one place that knows both nanochat/ and nag/.

An arch is a model class (a GPT subclass: its runtime hooks are optimizer_groups, set_tokens_seen,
after_optimizer_step, step_metrics, nonfinite_origin, extra_meta / extra_init_kwargs) plus an ArchSpec:
the functions it brings to the command line (its flags, the constructor and optimizer arguments read from
them, its telemetry). A new arch is a subclass plus one entry in ARCHS; base_train never names an arch.
"""

from dataclasses import dataclass, field

from nanochat.common import UserError, positive_float
from nanochat.gpt import GPT
from nanochat import checkpoint_manager as ckpt
from nanochat import plan as run_plan
from nanochat.resume import NOT_SETTINGS as BASELINE_NOT_SETTINGS
from nag.model import GATE_LR, NAGGPT, add_nag_args, nag_config_from_args
from nag.mod import add_mod_args, mod_config_from_args
from nag.presets import PRESETS
from nag.router_mod import RouterMoDGPT
from nanochat.recipe import PARTS as RECIPE_PARTS, RecipeGPT, RecipeParts, add_recipe_args, recipe_config_from_args
from nag.recipe import NAGRecipeGPT
from nag.rivals import LNSGPT, LayerRoPEGPT, PeriGPT, add_rival_args


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
    # constructor arguments beyond the GPTConfig, from parsed flags (may raise UserError)
    init_kwargs: callable = no_kwargs
    optimizer_kwargs: callable = no_kwargs  # extra keyword arguments of model.optimizer_groups, from parsed flags
    # (model, step, idx, args) -> (dict for metrics.jsonl or None, line to print or None)
    telemetry: callable = no_telemetry
    title: str = ""  # what it is, in a few words (the exported model card's heading)
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


def add_router_args(parser):
    g = parser.add_argument_group("router-MoD (used with --arch gpt-router, with the --mod-* flags)")
    g.add_argument(
        "--router-lr",
        type=positive_float,
        default=GATE_LR,
        help="AdamW LR of the routers (× batch LR scale); default: NAG's gate LR, as its NAG twin's gates",
    )


def router_init_kwargs(args):
    mod = mod_config_from_args(args)
    if mod is None:
        raise UserError("the router-MoD baseline needs --mod-rate (the target share of skipped token-sublayers)")
    return {"mod": mod}


ARCHS = {
    "gpt": ArchSpec(GPT, title="GPT baseline"),
    "nag": ArchSpec(
        NAGGPT,
        title="NAG (Norm-Agnostic residual network)",
        add_args=add_nag_and_mod_args,
        init_kwargs=nag_init_kwargs,
        optimizer_kwargs=lambda args: {"gate_lr": args.nag_gate_lr, "temp_gain_lr": args.nag_temp_gain_lr},
        telemetry=nag_telemetry,
        not_settings=frozenset({"nag_gate_log_every", "nag_impl"}),
    ),
    # today's nanochat recipe (nanochat/recipe.py, docs/design.md §10): the baseline with nanochat's record-run parts,
    # and NAG with the same parts carried over or adapted (nag/recipe.py); NAG-on-recipe reads the NAG and recipe flags
    "gpt-recipe": ArchSpec(
        RecipeGPT,
        title="GPT on nanochat's recipe",
        add_args=add_recipe_args,
        init_kwargs=recipe_init_kwargs,
        optimizer_kwargs=lambda args: {"scalar_lr": args.scalar_lr},
    ),
    "nag-recipe": ArchSpec(
        NAGRecipeGPT,
        title="NAG on nanochat's recipe",
        init_kwargs=nag_recipe_init_kwargs,
        optimizer_kwargs=lambda args: {
            "gate_lr": args.nag_gate_lr,
            "temp_gain_lr": args.nag_temp_gain_lr,
            "scalar_lr": args.scalar_lr,
        },
        telemetry=nag_telemetry,
    ),
    # the router-MoD baseline (paper eq. 40): the GPT with a learned router per skippable sub-layer; its --mod-*
    # flags are NAG-MoD's (registered once, by the nag spec)
    "gpt-router": ArchSpec(
        RouterMoDGPT,
        title="router-MoD GPT",
        add_args=add_router_args,
        init_kwargs=router_init_kwargs,
        optimizer_kwargs=lambda args: {"router_lr": args.router_lr},
    ),
    # the rival depth arms (nag/rivals.py, docs/design.md §11): the baseline with Layer-Norm Scaling, Peri-LN or
    # LayerRoPE; one flag group for the three (--rival-gain-lr: the gains' LR, read by the two with gains;
    # --layerrope-init, LayerRoPE's: FAMILIES below)
    "gpt-lns": ArchSpec(
        LNSGPT,
        title="GPT with Layer-Norm Scaling (arXiv:2502.05795)",
        add_args=add_rival_args,
        init_kwargs=LNSGPT.kwargs_from_args,
    ),
    "gpt-peri": ArchSpec(
        PeriGPT,
        title="Peri-LN GPT (arXiv:2502.02732)",
        add_args=add_rival_args,
        init_kwargs=PeriGPT.kwargs_from_args,
        optimizer_kwargs=lambda args: {"gain_lr": args.rival_gain_lr},
    ),
    "gpt-layerrope": ArchSpec(
        LayerRoPEGPT,
        title="GPT with LayerRoPE gains (arXiv:2610.09179)",
        add_args=add_rival_args,
        init_kwargs=LayerRoPEGPT.kwargs_from_args,
        optimizer_kwargs=lambda args: {"gain_lr": args.rival_gain_lr},
    ),
}

# every flag of every arch that changes no number a run trains (nanochat/resume.py says what that list is for)
NOT_SETTINGS = BASELINE_NOT_SETTINGS | frozenset().union(*(s.not_settings for s in ARCHS.values()))


def arch_spec(arch):
    if arch in ARCHS:
        return ARCHS[arch]
    raise UserError(f"unknown arch {arch!r} (expected one of: {', '.join(ARCHS)})")


def is_nag_arch(arch):
    """Whether an arch name is a NAG model (it reads the --nag-* flags and a preset's NAG flags)."""
    return arch in ARCHS and issubclass(ARCHS[arch].model_class, NAGGPT)


def model_class(arch):
    return arch_spec(arch).model_class


def add_arch_args(parser):
    """Every arch's own flags (each registered once, whatever arch the command line picks)."""
    for add_args in dict.fromkeys(s.add_args for s in ARCHS.values()):
        add_args(parser)


def mod_asked(args):
    return getattr(args, "mod_rate", None) is not None or bool(getattr(args, "mod_blocks", None))


def arch_for_args(args):
    """(arch name, ArchSpec) that the flags ask for; the --mod-* flags only where the arch skips tokens."""
    spec = arch_spec(args.arch)
    if mod_asked(args) and not issubclass(spec.model_class, (NAGGPT, RouterMoDGPT)):
        raise UserError(
            f"--arch {args.arch} has no Mixture-of-Depths: drop the --mod-* flags, or use --arch nag "
            "(skips by its rotation score) or --arch gpt-router (the router-MoD baseline)"
        )
    if issubclass(spec.model_class, NAGRecipeGPT) and mod_asked(args):
        raise UserError(f"--arch {args.arch} has no Mixture-of-Depths: drop the --mod-* flags, or use --arch nag")
    return args.arch, spec


RECIPE_FLAGS = frozenset({f"no_{part}" for part in RECIPE_PARTS} | {"scalar_lr"})
# the flag families an arch may not read: which flags belong to one, which model classes read it, what to call them
FAMILIES = {
    "nag": (lambda k: k.startswith("nag_"), NAGGPT, "a NAG arch"),
    "recipe": (lambda k: k in RECIPE_FLAGS, RecipeParts, "a recipe arch"),
    "router": (lambda k: k.startswith("router_"), RouterMoDGPT, "the router-MoD arch"),
    # the rival arms' flags, each read by the arms it is about: LNS has no gains, only LayerRoPE an init
    "rival": (lambda k: k == "rival_gain_lr", (PeriGPT, LayerRoPEGPT), "a rival arm with learned gains"),
    "layerrope": (lambda k: k.startswith("layerrope_"), LayerRoPEGPT, "LayerRoPE"),
}


def family_of(key):
    return next((name for name, (member, _, _) in FAMILIES.items() if member(key)), None)


def unread_flags(args):
    """{flag key: family} of every family flag the arch of args does not read, whatever its value: no setting
    of that run. Its value is recorded in config.json's args as given, but a resume never compares it (base_train adds
    these to the not-settings), so --no-smear or --scalar-lr given to, or dropped from, a gpt run never blocks it."""
    _, spec = arch_for_args(args)
    out = {}
    for k in vars(args):
        family = family_of(k)
        if family and not issubclass(spec.model_class, FAMILIES[family][1]) and k not in spec.reads:
            out[k] = family
    return out


def ignored_flags(args, defaults):
    """Notes on the family flags set on an arch that does not read them (defaults: the parser's defaults). Not an
    error: speedrun.sh passes one flag list to both runs of a pair; but never silent either."""
    given = {}
    for k, family in unread_flags(args).items():
        if getattr(args, k) != getattr(defaults, k):
            given.setdefault(family, []).append(f"--{k.replace('_', '-')}")
    notes = []
    for family, flags in given.items():
        readers = [a for a, s in ARCHS.items() if issubclass(s.model_class, FAMILIES[family][1])]
        one = len(flags) == 1
        notes.append(
            f"note: {', '.join(flags)} {'applies' if one else 'apply'} only with {FAMILIES[family][2]} "
            f"({', '.join(readers)}); this {args.arch} run ignores {'it' if one else 'them'}"
        )
    return notes


def check_args(args):
    """base_train's flags checked (nanochat/plan.py) and its arch picked: one line for the first problem."""
    run_plan.check_args(args)
    return arch_for_args(args)


def plan_for(args, vocab_size, nproc, device_type=None):
    """The Plan (nanochat/plan.py) of a run's flags: its arch's model built on the meta device, batch, horizon, LRs,
    memory. device_type: where it trains (None: a plan only; see nanochat.plan.plan_target)."""
    arch, spec = check_args(args)
    preset = PRESETS.get(args.preset, {})
    target = run_plan.plan_target(args, device_type, bool(preset.get("gpu")), preset.get("planned_gpu"))
    return run_plan.make_plan(
        args, vocab_size, nproc, arch, spec.model_class, spec.init_kwargs(args), spec.optimizer_kwargs(args), target
    )


def load_model(run_dir, step=None, device="cpu"):
    """(model, meta) of a run's latest (or given) complete checkpoint, in eval mode."""
    return ckpt.load_model(run_dir, step, device, model_class)
