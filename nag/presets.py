"""
Named configurations for base_train (`--preset NAME`).

Each comes with the matching base_eval and analysis arguments that speedrun.sh passes.

A preset is a list of flags placed before the command line's own, so any flag given
after it wins. A preset marked "gpu" is refused where torch sees no CUDA device (unless
--device-type cpu is given), and trains only with a tokenizer of its "vocab". The published preset reproduces the
FLOP-matched pair of the NAG walkthrough (docs/reproduce.md has every value with its source).
"""

from nanochat.common import UserError

# flag lists keep their flag-value pairs together, so the formatter leaves them as written
# fmt: off
PRESETS = {
    # 64 blocks × dim 640, 5 heads × 128, seq 2048, 3e19 FLOPs, batch 2^20; the published run's LRs (before
    # the √(B/2^19) batch scaling that base_train applies); Muon momentum follows base_train's schedule. The device
    # batch is the memory plan's: the published 16 on an 80 GB H100, less on a smaller GPU, more on a larger one.
    "published": {
        "train": ["--depth", "64", "--model-dim", "640", "--head-dim", "128", "--max-seq-len", "2048",
                  "--window-pattern", "L", "--target-flops", "3e19", "--total-batch-size", "1048576",
                  "--warmup-steps", "40", "--warmdown-ratio", "0.65", "--final-lr-frac", "0.05",
                  "--matrix-lr", "0.012", "--embedding-lr", "0.18", "--unembedding-lr", "0.006",
                  "--eval-tokens", str(80 * 2 ** 19)],
        "nag": [],  # its gate and temperature-gain LRs are NAG's defaults (nag/model.py: GATE_LR, TEMP_GAIN_LR)
        # the published val bpb was measured on 80 × 2^19 tokens
        "eval": ["--split-tokens", str(80 * 2 ** 19)],
        "analysis": ["--tokens", str(2 ** 20)],
        "vocab": 32768,
        "gpu": True,
    },
    # the walkthrough's pilot pairs before the published run: depth 26 at 1e18 and 3e18 FLOPs, each a GPT / NAG pair
    # (NAG - GPT val bpb 0.038, then 0.016), on two RTX 5090s. Width 640 (5 × 128) and every other value as the
    # published preset's where the fork's code and figures imply it (docs/reproduce.md has each value's source);
    # batch 2^19 (the size rule at depth 26), so no √2 on the LRs. The device batch is left to the memory plan.
    "pilot": {
        "train": ["--depth", "26", "--model-dim", "640", "--head-dim", "128", "--max-seq-len", "2048",
                  "--window-pattern", "L", "--total-batch-size", "524288", "--target-flops", "1e18",
                  "--warmup-steps", "40", "--warmdown-ratio", "0.65", "--final-lr-frac", "0.05",
                  "--matrix-lr", "0.012", "--embedding-lr", "0.18", "--unembedding-lr", "0.006",
                  "--eval-every", "250", "--eval-tokens", str(80 * 2 ** 19)],
        "nag": [],
        "eval": ["--split-tokens", str(80 * 2 ** 19)],
        "analysis": ["--tokens", str(2 ** 20)],
        "vocab": 32768,
        "gpu": True,
        "budgets": [1e18, 3e18],  # speedrun trains the first; --flops 3e18 the second (runs/pilot_pairs.sh: both)
        "gpus": 2,  # planned without GPUs here: 2 × RTX 5090, as the walkthrough's
        "planned_gpu": "rtx5090",
    },
    # nanochat's record, dev/LEADERBOARD.md "Run 6" (karpathy/nanochat a825e63; runs/speedrun.sh,
    # base_train.py defaults): d24 (dim 1536, 12 heads × 128), SSSL windows, tokens = 8 × S, fp8,
    # batch 2^20 (what nanochat's batch rule gives at d24), its LRs and schedule, on the recipe baseline;
    # its NAG twin on the same FLOPs (docs/design.md §10). The Muon decay: nanochat scales 0.28 from its
    # d12 (dim 768) to 0.0597384 at d24; ours scales from the d12 of the same width, so the flag that lands
    # on 0.0597384 is 0.0790324 (tests/test_recipe.py checks both figures).
    "run6": {
        "train": ["--depth", "24", "--head-dim", "128", "--max-seq-len", "2048", "--window-pattern", "SSSL",
                  "--target-param-data-ratio", "8", "--total-batch-size", "1048576", "--device-batch-size", "16",
                  "--warmup-steps", "40", "--warmdown-ratio", "0.65", "--final-lr-frac", "0.05",
                  "--matrix-lr", "0.02", "--embedding-lr", "0.3", "--unembedding-lr", "0.008", "--scalar-lr", "0.5",
                  "--weight-decay", "0.0790324", "--fp8", "--eval-every", "250", "--eval-tokens", str(80 * 2 ** 19)],
        # the baseline's planned FLOPs (5,568 steps × 2^20 tokens × 4,775,225,616 FLOPs/token):
        # the NAG twin takes fewer steps
        "nag": ["--target-flops", "2.7880017079711039e19"],
        "eval": ["--split-tokens", str(80 * 2 ** 19)],
        "analysis": ["--tokens", str(2 ** 20)],
        "vocab": 32768,
        "gpu": True,
        "pair": {"gpt": "gpt-recipe", "nag": "nag-recipe"},  # the archs of speedrun's two runs (default: gpt and nag)
    },
    # nanochat-d20-like: dim 1280, 10 heads × 128, batch and horizon from the size rules
    "d20": {
        "train": ["--depth", "20", "--head-dim", "128", "--max-seq-len", "2048", "--window-pattern", "L",
                  "--device-batch-size", "32"],
        "nag": [], "eval": [], "analysis": ["--tokens", str(2 ** 20)], "vocab": 32768, "gpu": True,
    },
    # the CPU demo of runs/runcpu.sh: 4 blocks × 256 (4 heads of 64), seq 256, 4096 tokens per step, 1e13 FLOPs
    # (~90 steps). At this batch the batch rule scales every LR by √(4096/2^19) ≈ 0.09, so the base LRs are raised.
    # NAG, same treatment: the α warm-up shrinks to 10 steps' worth of tokens (published: ~300 steps), and the gate
    # and temperature-gain LRs go up, since in ~90 steps log G_encode (NAG's inverse temperature) must still grow
    # by a few units; at the default 0.005 × 0.09 it moves by ~0.01 and caps how confident NAG can get.
    "demo": {
        "train": ["--depth", "4", "--head-dim", "64", "--max-seq-len", "256", "--device-batch-size", "16",
                  "--total-batch-size", "4096", "--target-flops", "1e13", "--warmup-steps", "5", "--matrix-lr", "0.2",
                  "--embedding-lr", "2.0", "--unembedding-lr", "0.1", "--eval-every", "30", "--eval-tokens", "16384",
                  "--save-every", "30"],
        "nag": ["--nag-alpha-warmup-tokens", "40960", "--nag-gate-log-every", "10", "--nag-gate-lr", "0.01",
                "--nag-temp-gain-lr", "1.0"],
        # 65,536 tokens of 4 × 256 batches (62 in one pass over the offline val split): enough units for an interval
        "eval": ["--split-tokens", "65536", "--device-batch-size", "4"],
        "analysis": ["--tokens", "65536"],
        "vocab": 4096,
    },
    # a CPU smoke test of the whole pipeline: 2 layers × 64, 256 tokens per step, LRs raised against the
    # tiny-batch LR scale (√(256/2^19) ≈ 0.022)
    "tiny": {
        "train": ["--depth", "2", "--model-dim", "64", "--head-dim", "32", "--max-seq-len", "64",
                  "--device-batch-size", "4", "--total-batch-size", "256", "--target-flops", "2e10",
                  "--warmup-steps", "2", "--matrix-lr", "0.5",
                  "--embedding-lr", "2.0", "--unembedding-lr", "0.1", "--eval-every", "20", "--eval-tokens", "512",
                  "--save-every", "20", "--device-type", "cpu"],
        "nag": ["--nag-alpha-warmup-tokens", "1024", "--nag-gate-log-every", "10"],
        "eval": ["--max-per-task", "8", "--split-tokens", "512", "--device-batch-size", "4", "--sample-tokens", "8",
                 "--device-type", "cpu"],
        "analysis": ["--tokens", "1024", "--clusters", "4", "--state-sample", "64", "--device-batch-size", "4",
                     "--device-type", "cpu"],
        "vocab": 512,
    },
}
# fmt: on


def get_preset(name):
    if name not in PRESETS:
        raise UserError(f"unknown preset {name!r} (expected one of: {', '.join(PRESETS)})")
    return PRESETS[name]


def pair_arch(name, role):
    """The arch of a preset's "gpt" or "nag" run (speedrun's --arch names the roles)."""
    return get_preset(name).get("pair", {}).get(role, role)


def preset_args(name, arch):
    """base_train flags of a preset for one arch ([] without a preset): its "nag" flags go to every NAG arch."""
    if not name:
        return []
    from nag.archs import is_nag_arch  # here: nag.archs imports the models, which a preset lookup does not need

    p = get_preset(name)
    return p["train"] + (p["nag"] if is_nag_arch(arch) else [])
