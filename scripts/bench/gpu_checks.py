"""
The measurements only a GPU can make, sized for a GPU borrowed for a few minutes.

They need no network and no data: the benchmarks use random tokens, and the base_train stages an offline corpus
they write from the standard library.

    bash runs/gpu_checks.sh --quick    # (GPU) at most 7 minutes on one H100/H200, compiles included
    bash runs/gpu_checks.sh            # (GPU) also base_train's loop, attention, MFU, depth 4 with cold compiles, per-block compile, the published shape at full depth, MoD per block, base_train with fp8 and MoD, CORE batching (EVAL_BUNDLE=DIR)
    python -m scripts.bench.gpu_checks --quick --dry-run   # the stages, their limits and expected times, the files; needs no GPU

Without a GPU it says so in one line and stops. Otherwise the stages run in the order a first GPU slot must answer
them (kernels right on CUDA; GPT, NAG fused and NAG compiled: step time and memory; the branch op; MoD compiled
against full depth), each in its own process under its own time limit, and all of them under
--budget: a stage whose expected time is no longer left is SKIPPED (not a failure). The stages share one Inductor
and one Triton cache in the work folder, so a graph or kernel compiles once per run; the one stage marked cold
gives each of its variants empty caches, and its compile seconds are the cold ones. The moment a stage ends, three
files in $OUT are brought up to date, so a run cut short keeps every stage that finished, and a borrowed GPU slot,
which returns at most 8 files, returns them all (OUTPUTS):
  results.json   every stage's status and figures, and the machine (GPU, driver, torch, Triton, CUDA)
  summary.md     a line per stage, then the headline figures
  logs.tar.gz    every stage's log and env.json
A stage that fails or runs out of time is marked FAILED and the exit status is 1.
"""

import os
import sys
import json
import math
import time
import shutil
import signal
import tarfile
import statistics
import argparse
import tempfile
import subprocess
import importlib.util
import xml.etree.ElementTree as ET
from dataclasses import dataclass

# scripts/bench/ is two below the repo root
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# all that goes in $OUT, at its top: a borrowed slot returns at most 8 files
OUTPUTS = ("results.json", "summary.md", "logs.tar.gz")
QUICK_BUDGET, FULL_BUDGET = 420, 2400  # seconds; a borrowed slot gives a command 10 minutes, its start-up included
# the quick stages' expected times fit this share of its budget: the rest is room for a slower machine or a colder
# start. 0.75 while the times were guesses; 0.9 now that all but mod's are the first H200's seconds (issue 47 wants
# base_train in the quick run, issue 48 the mod stage; neither fits under 0.8). mod runs last: a slow run skips only it
PLANNED = 0.9
CACHE = "compile_cache"  # in the work folder: the Inductor and Triton caches every stage but a cold one shares
# flag lists keep their flag-value pairs together
# fmt: off
PUBLISHED_SHAPE = [
    "--model-dim", "640", "--head-dim", "128", "--max-seq-len", "2048", "--device-batch-size", "16",
    "--vocab-size", "32768",
]
D24 = [
    "--depth", "24", "--head-dim", "128", "--max-seq-len", "2048", "--device-batch-size", "16",
    "--vocab-size", "32768",
]
D20 = [
    "--depth", "20", "--head-dim", "128", "--max-seq-len", "2048", "--device-batch-size", "32",
    "--vocab-size", "32768",
]
# fmt: on
TIMED = ["--steps", "10", "--warmup", "3"]
# base_train itself at the step stage's shape (the published width, depth 8, 16 × 2048): one micro-batch a step, no
# evaluation, the one checkpoint at the end, compiled as base_train compiles on CUDA (its default)
# fmt: off
BASE_TRAIN = [
    "--arch", "nag", "--depth", "8", "--model-dim", "640", "--head-dim", "128", "--max-seq-len", "2048",
    "--device-batch-size", "16", "--total-batch-size", str(16 * 2048), "--eval-every", "-1", "--save-every", "0",
]
# fmt: on
# NAG-MoD at 20 % skipped with --fp8, 3 steps, compiled (base_train compiles MoD as any model since issue 48)
FP8_MOD = [*BASE_TRAIN, "--num-iterations", "3", "--fp8", "--mod-rate", "0.2"]
# its steps after the first, compiled: at most this many ms (the first H200 took 1,183 and 1,012 eager; NAG 47.6)
FP8_MOD_STEP_MS = 100
# scripts.bench.mod at the step stage's shape on the GPU (never the CPU it defaults to without one: the second slot's
# mod stage timed the slot's CPU), compiled as base_train compiles there, the reference and 20 and 40 % skipped; the
# steps are cheap beside the compiles: 2 to compile and settle, 5 timed
# fmt: off
MOD_BENCH = [
    "--device-type", "cuda", "--compile", "on", "--depth", "8", *PUBLISHED_SHAPE, "--rates", "0.2,0.4",
    "--steps", "5", "--warmup", "2", "--json", "{json}",
]
# fmt: on
# the step stage's nag:fused in base_train's own loop (data, the one host read, logging): the bench's attention kernel
# and NAG implementation, so that a difference is the loop's; 4 steps after the one that compiles
NAG_TRAIN = [*BASE_TRAIN, "--num-iterations", "5", "--attn", "sdpa", "--nag-impl", "fused"]
NAG_TRAIN_WITHIN = 0.10  # base_train's step after the first against the bench's nag:fused step: the claim
# the base_train stage's corpus: this many of the standard library's docs (~1,300 documents, ~1 MB of text)
OFFLINE_DOCS = 200
ROWS_PER_PROGRAM = "1,2,4,8,16,32"  # the fused backward's sweep (nag.kernels.BACKWARD_ROWS_PER_PROGRAM is the default)
# A borrowed GPU slot's own python3 (Python 3.12, torch 2.11.0+cu130, Triton 3.6.0), which runs/gpu_checks.sh takes when
# the tree has no .venv: the distributions it has (with what they require), and what it lacks. It has no network either.
# tests/test_gpu_checks.py builds its fake slot from SLOT_HAS; docs/gpu_checks.md lists both.
SLOT_HAS = ("torch", "triton", "pyarrow", "PyYAML", "pytest", "numpy", "matplotlib", "tiktoken")
SLOT_LACKS = ("rustbpe", "flash-attn-4")


@dataclass
class Stage:
    name: str
    what: str
    cmd: list  # "{json}" stands for the stage's JSON path
    timeout: float  # seconds
    expect: float  # seconds expected on one H100/H200 with the run's shared caches (a guess until a GPU has timed it)
    figures: object = None  # the stage's JSON -> a short text for its summary line
    writes_json: bool = True  # False: the runner writes the JSON (the end of the log)
    cold: bool = False  # True: no shared compiler caches (bench_train --fresh-cache: empty ones per variant)
    against: str = ""  # another stage whose JSON the figures take too: figures(d, that JSON or None)


def bench_train(name, what, timeout, expect, *argv, cold=False):
    cmd = [
        sys.executable,
        "-m",
        "scripts.bench.train",
        *argv,
        *TIMED,
        *(["--fresh-cache"] if cold else []),
        "--json",
        "{json}",
    ]
    return Stage(name, what, cmd, timeout, expect, step_figures, cold=cold)


def stages(quick, eval_bundle=None):
    py = sys.executable
    out = [
        # the CUDA variants alone: the sm_90 build report (test_kernels_build_for_hopper) needs no GPU and runs on a CPU
        Stage(
            "kernel_tests",
            "fused-kernel CUDA tests: vs the reference, leading dims, failure 1, custom ops, inductor compile",
            [py, "-m", "scripts.bench.gpu_checks", "--kernel-tests", "{json}"],
            150,
            55,  # on the first H200
            kernel_figures,
        ),
        bench_train(
            "step",
            "GPT vs NAG fused vs NAG compiled (Inductor over the reference math), published shape (640 wide, "
            "16 × 2048) at depth 8, compiled whole: step time (forward + backward, optimizer), memory, the faster NAG",
            180,
            117,  # 78 s for GPT and NAG-fused on the first H200; a third variant adds about half
            "--depth",
            "8",
            *PUBLISHED_SHAPE,
            "--arch",
            "gpt,nag:fused,nag:compiled",
            "--compile",
            "on",
        ),
        Stage(
            "branch_op",
            "branch op alone, 16 × 2048 rows × 640, bf16: each direction timed alone, GB/s against a copy, fused "
            "against Inductor; the fused backward by rows per program",
            [
                py,
                "-m",
                "scripts.bench.nag",
                "--sections",
                "op",
                "--impls",
                "reference,compiled,fused",
                "--op-rows",
                str(16 * 2048),
                "--op-dim",
                "640",
                "--op-rows-per-program",
                ROWS_PER_PROGRAM,
                "--json",
                "{json}",
            ],
            90,
            34,  # on the first H200
            op_figures,
        ),
        # base_train's loop against the bench's step: the first H200 saw steps 2-4 at 84 ms (the GPU idle while the
        # host fetched the next batch) where the bench's nag:fused step took 47.6
        Stage(
            "base_train",
            "base_train --arch nag (fused, SDPA), 5 steps at the step stage's shape, compiled as base_train compiles, "
            "an offline corpus: a step after the first against the step stage's nag:fused",
            [py, "-m", "scripts.bench.gpu_checks", "--base-train", "{json}", "--vocab-size", "32768", *NAG_TRAIN],
            160,
            # 79 s on the first H200, 48 of them its first step's compile, cold; here it follows the step stage, whose
            # nag:fused is the same graph in the shared caches (the step stage's NAG compiled in 5 s after it there)
            40,
            nag_train_figures,
            against="step",
        ),
        # issue 48, last: its expected time is a guess, and last it has all the budget the measured stages leave
        Stage(
            "mod",
            "NAG-MoD, both blocks, at 20 and 40 % skipped vs full depth, bf16 and fp8, the step stage's shape, "
            "compiled whole: step time and peak memory against issue 48's targets",
            [py, "-m", "scripts.bench.mod", *MOD_BENCH, "--blocks", "both", "--precision", "bf16,fp8"]
            + ["--layer-repeats", "0"],  # the sub-layers alone: the full run's mod_blocks
            240,
            120,  # a guess: five compiles of the depth-8 model (~27 s each on the first H200), their steps < 0.1 s
            mod_figures,
        ),
    ]
    if quick:
        return out
    out += [
        # every kernel that loads here (FA4 if the gpu extra is installed, FA3 only from a cached hub copy: no network)
        Stage(
            "attention",
            "attention alone, every kernel that loads (SDPA flash and cuDNN, FA4, FA3), 16 × 2048, 5 heads × 128, "
            "bf16, windows L and S (S: the kernel's own window or flex_attention's block mask, built once, against a "
            "dense mask): each direction's time, S against L, and the kernel --attn auto times fastest",
            [py, "-m", "scripts.bench.attention", "--compile", "--json", "{json}"],
            90,
            48,  # on the first H200, before auto timed the kernels
            attention_figures,
        ),
        # did not fit --quick on the first H200
        bench_train(
            "mfu",
            "GPT d20-like (20 × 1280, 32 × 2048), compiled whole: MFU",
            120,
            70,
            *D20,
            "--arch",
            "gpt",
            "--compile",
            "on",
        ),
        # the one cold stage: every compile seconds figure elsewhere is with the run's warm caches
        bench_train(
            "depth",
            "GPT vs NAG-fused at depth 4 (with step: per-layer cost, carried "
            "to 64), empty caches: cold compile, model and optimizer",
            180,
            100,
            "--depth",
            "4",
            *PUBLISHED_SHAPE,
            "--arch",
            "gpt,nag:fused",
            "--compile",
            "on",
            cold=True,
        ),
        bench_train(
            "blocks",
            "GPT vs NAG-fused at depth 8, each block compiled on its own (compare with step)",
            120,
            60,
            "--depth",
            "8",
            *PUBLISHED_SHAPE,
            "--arch",
            "gpt,nag:fused",
            "--compile",
            "blocks",
        ),
        bench_train(
            "host_reads",
            "GPT vs NAG-fused at depth 8, base_train's one host read per step vs two (the finite check read "
            "before the update is queued, as before)",
            150,
            70,
            "--depth",
            "8",
            *PUBLISHED_SHAPE,
            "--arch",
            "gpt,nag:fused",
            "--compile",
            "on",
            "--host-reads",
            "1,2",
        ),
        bench_train(
            "fp8",
            "fp8 vs bf16 (base_train --fp8), GPT vs NAG-fused at the published shape, depth 8: step time, MFU",
            180,
            90,
            "--depth",
            "8",
            *PUBLISHED_SHAPE,
            "--arch",
            "gpt,nag:fused",
            "--compile",
            "on",
            "--precision",
            "bf16,fp8",
        ),
        bench_train(
            "fp8_d24",
            "fp8 vs bf16 at nanochat's d24 (24 × 1536, 16 × 2048), GPT vs NAG-fused: step time, MFU",
            300,
            150,
            *D24,
            "--arch",
            "gpt,nag:fused",
            "--compile",
            "on",
            "--precision",
            "bf16,fp8",
        ),
        bench_train(
            "published_gpt",
            "GPT at the published shape, depth 64, compiled whole",
            420,
            200,
            "--depth",
            "64",
            *PUBLISHED_SHAPE,
            "--arch",
            "gpt",
            "--compile",
            "on",
        ),
        bench_train(
            "published_nag",
            "NAG-fused at the published shape, depth 64, compiled whole",
            480,
            240,
            "--depth",
            "64",
            *PUBLISHED_SHAPE,
            "--arch",
            "nag:fused",
            "--compile",
            "on",
        ),
        bench_train(
            "published_blocks",
            "GPT vs NAG-fused at depth 64, each block compiled on its own",
            240,
            100,
            "--depth",
            "64",
            *PUBLISHED_SHAPE,
            "--arch",
            "gpt,nag:fused",
            "--compile",
            "blocks",
        ),
        # the quick run's mod stage had both blocks: here each alone, and each sub-layer alone (the layer bench)
        Stage(
            "mod_blocks",
            "NAG-MoD, attention or MLP alone, at 20 and 40 % skipped vs full depth, the step stage's shape, compiled "
            "whole; each sub-layer alone, eager and compiled: time saved for FLOPs saved",
            [py, "-m", "scripts.bench.mod", *MOD_BENCH, "--blocks", "attn,mlp"],
            300,
            150,  # a guess: five compiles as in mod, and eight sub-layer ones
            mod_figures,
        ),
        # base_train itself (not a benchmark's copy of its step): --fp8 with MoD's packed tokens on CUDA's _scaled_mm,
        # which checks its shapes (the CPU's does not), compiled as base_train compiles MoD now (issue 48); the quick
        # run's mod stage times the same model in the bench
        Stage(
            "fp8_mod",
            "base_train --fp8 --mod-rate 0.2 (NAG-MoD, both blocks), 3 steps at the published width (640, 16 × 2048), "
            "depth 8, compiled as base_train compiles, an offline corpus: each step's time, skip rates",
            [py, "-m", "scripts.bench.gpu_checks", "--base-train", "{json}", "--vocab-size", "32768", *FP8_MOD],
            200,
            80,  # the first H200 ran it eager in 30 s (1.1 s steps); now a compile of ~50 s as base_train NAG's
            fp8_mod_figures,
        ),
    ]
    if eval_bundle:
        out.append(
            Stage(
                "core_batching",
                "CORE scoring batched vs one at a time on the GPU",
                [
                    py,
                    "-m",
                    "scripts.bench.core",
                    "--eval-bundle",
                    eval_bundle,
                    "--depth",
                    "12",
                    "--dim",
                    "768",
                    "--seq-len",
                    "2048",
                    "--threads",
                    "0",
                ],
                300,
                120,
                writes_json=False,
            )
        )
    return out


# ---------------------------------------------------------------------------
# the runner


def run_stages(stage_list, work, budget, out=None, env=None):
    """Run the stages in order in `work` (each writes <stage>.json and <stage>.log there), each under min(its time
    limit, what is left of the budget); one whose expected time is no longer left is skipped. As soon as one ends,
    its line goes to out/summary.md and out/results.json and out/logs.tar.gz are rewritten (out: default work).
    Returns the names of the stages that failed (a skipped one has not)."""
    out = out or work
    deadline = time.time() + budget
    failed, status = [], {}
    for st in stage_list:
        left = deadline - time.time()
        if os.path.exists(os.path.join(work, st.name + ".json")):
            os.remove(os.path.join(work, st.name + ".json"))  # an earlier run's figures must not stand in
        print(
            f"=== {st.name}: {st.what} (limit {min(st.timeout, max(left, 0)):.0f} s, expected {st.expect:.0f} s) ===",
            flush=True,
        )
        if left < st.expect:
            result, seconds, note = (
                "SKIPPED",
                0.0,
                f"not started: {max(left, 0):.0f} s of the {budget:.0f} s budget left, it expects {st.expect:.0f} s",
            )
        else:
            ok, seconds, note = run_stage(st, work, min(st.timeout, left))
            result = "ok" if ok else "FAILED"
        if result == "FAILED":
            failed.append(st.name)
            print("\n".join(log_tail(os.path.join(work, st.name + ".log"), 20)))
        line = f"| {st.name} | {result} | {seconds:.0f} | {note} |"
        with open(os.path.join(out, "summary.md"), "a") as f:
            f.write(line + "\n")
        status[st.name] = {
            "result": result,
            "ok": result == "ok",
            "seconds": round(seconds, 1),
            "note": note,
            "what": st.what,
            "limit_s": st.timeout,
            "expect_s": st.expect,
            "cold": st.cold,
        }
        collect(work, out, status, env)
        print(line, flush=True)
    return failed


def collect(work, out, status, env=None):
    """out/results.json (the machine, and each stage's status and figures) and out/logs.tar.gz (every log in work),
    each written whole under a temporary name and renamed, so a run killed at any point leaves the last complete
    pair."""
    results = {
        "env": env,
        "stages": {name: {**s, "figures": load(work, name) if s["ok"] else None} for name, s in status.items()},
    }
    tmp = os.path.join(out, ".results.json.tmp")
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1)
    os.replace(tmp, os.path.join(out, "results.json"))
    tmp = os.path.join(out, ".logs.tar.gz.tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for name in sorted(os.listdir(work)):
            if name.endswith(".log") or name == "env.json":
                tar.add(os.path.join(work, name), arcname=f"gpu_checks_logs/{name}")
    os.replace(tmp, os.path.join(out, "logs.tar.gz"))


def stage_env(st, work):
    """The stage process's environment: the run's shared compiler caches, none for a cold stage (bench_train's
    --fresh-cache gives each of its variants empty ones)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    caches = {
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(work, CACHE, "inductor"),
        "TRITON_CACHE_DIR": os.path.join(work, CACHE, "triton"),
    }
    for k, v in caches.items():
        if st.cold:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def run_stage(st, out, limit):
    """(ok, seconds, note). The stage runs in a process group of its own, so a timeout ends its children too."""
    json_path = os.path.join(out, st.name + ".json")
    log_path = os.path.join(out, st.name + ".log")
    cmd = [json_path if a == "{json}" else a for a in st.cmd]
    t0 = time.time()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=stage_env(st, out), start_new_session=True
        )
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    seconds = time.time() - t0
    last = (log_tail(log_path, 1) or [""])[0][:200]
    if rc is None:
        return False, seconds, f"timed out after {limit:.0f} s" + (" (the budget's end)" if limit < st.timeout else "")
    if rc != 0:
        return False, seconds, f"exit {rc}: {last}"
    if not st.writes_json:
        with open(json_path, "w") as f:
            json.dump({"log_tail": log_tail(log_path, 30)}, f, indent=1)
    if not os.path.exists(json_path):
        return False, seconds, f"exit 0 but no {st.name}.json"
    try:
        with open(json_path) as f:
            data = json.load(f)
        if st.against:
            return True, seconds, st.figures(data, load(out, st.against))
        return True, seconds, st.figures(data) if st.figures else last
    except Exception as e:  # a malformed JSON fails this stage, not the run
        return False, seconds, f"figures unreadable: {type(e).__name__}: {e}"


def log_tail(path, n):
    try:
        with open(path, errors="replace") as f:
            return [l.rstrip("\n") for l in f.readlines()[-n:]]
    except OSError:
        return []


# ---------------------------------------------------------------------------
# the kernel tests stage: pytest, then a check that the GPU was really tested


def kernel_tests(json_path):
    """The fused kernel's CUDA tests. Ok only if pytest passed, at least one CUDA test passed and none was
    skipped: without a GPU torch sees, the CUDA tests skip themselves and pytest alone would say "passed"."""
    # a machine's own python3 may lack pytest, and a borrowed slot has no network
    if importlib.util.find_spec("pytest") is None:
        sys.exit(f"error: kernel tests: no pytest for {sys.executable}")
    xml = json_path + ".xml"
    rc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/test_nag_kernels.py",
            "-k",
            "cuda",
            f"--junitxml={xml}",
        ],
        cwd=REPO,
    ).returncode
    tests = []
    if os.path.exists(xml):
        for case in ET.parse(xml).getroot().iter("testcase"):
            kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
            reason = next((c.get("message", "") for c in case if c.tag in ("failure", "error", "skipped")), "")
            tests.append({"name": case.get("name"), "result": kind, "reason": reason[:300]})
        os.remove(xml)
    count = {k: sum(t["result"] == k for t in tests) for k in ("passed", "failure", "error", "skipped")}
    cuda_passed = sum(t["result"] == "passed" and "cuda" in t["name"].lower() for t in tests)
    cuda_skipped = sum(t["result"] == "skipped" and "cuda" in t["name"].lower() for t in tests)
    ok = rc == 0 and cuda_passed > 0 and cuda_skipped == 0
    with open(json_path, "w") as f:
        json.dump(
            {
                "pytest_exit": rc,
                **count,
                "cuda_passed": cuda_passed,
                "cuda_skipped": cuda_skipped,
                "ok": ok,
                "tests": tests,
            },
            f,
            indent=1,
        )
    if not ok:
        print(
            f"error: kernel tests: pytest exit {rc}, {cuda_passed} CUDA test(s) passed, {cuda_skipped} skipped, "
            f"{count['failure'] + count['error']} failed",
            file=sys.stderr,
        )
        sys.exit(1)


# ---------------------------------------------------------------------------
# the base_train stage: a few steps of base_train itself, on an offline corpus and a tokenizer of byte pairs


def pair_tokenizer(vocab_size):
    """A tokenizer of vocab_size tokens made without training (a borrowed slot has no rustbpe): the 256 bytes, then
    pairs of bytes (the printable ASCII pairs first), then the special tokens. It encodes any text, about two bytes
    a token; its merges mean nothing, which a step's time does not mind."""
    import tiktoken
    from nanochat.common import UserError
    from nanochat.tokenizer import Tokenizer, SPECIAL_TOKENS, SPLIT_PATTERN

    pairs = vocab_size - len(SPECIAL_TOKENS) - 256
    if not 0 <= pairs <= 256 * 256:
        raise UserError(
            f"--vocab-size {vocab_size}: a tokenizer of byte pairs has {256 + len(SPECIAL_TOKENS)} to "
            f"{256 + 256 * 256 + len(SPECIAL_TOKENS)} tokens"
        )
    printable = range(32, 127)
    order = [bytes([a, b]) for a in printable for b in printable]
    order += [bytes([a, b]) for a in range(256) for b in range(256) if not (a in printable and b in printable)]
    ranks = {bytes([i]): i for i in range(256)}
    ranks.update((token, 256 + i) for i, token in enumerate(order[:pairs]))
    specials = {name: len(ranks) + i for i, name in enumerate(SPECIAL_TOKENS)}
    return Tokenizer(
        tiktoken.Encoding(
            name="gpu_checks_pairs", pat_str=SPLIT_PATTERN, mergeable_ranks=ranks, special_tokens=specials
        )
    )


def base_train_stage(json_path, argv):
    """base_train with argv (its flags, and --vocab-size N: the tokenizer's) in a new NANOCHAT_BASE_DIR holding an
    offline corpus (OFFLINE_DOCS of the standard library's docs: nanochat.dataset, pyarrow) and pair_tokenizer(N).
    Writes
    json_path: base_train's exit status, the run's fp8 layers and attention kernel, and each step's time, loss, MoD skip
    rates and MFU from its metrics.jsonl. Exit status 1 if base_train failed, or ran no layer in fp8 with --fp8, or
    skipped no token with --mod-rate."""
    from nanochat.dataset import build_offline_corpus
    from nanochat.run_dir import metrics_path, metrics_lines, read_config

    i = argv.index("--vocab-size")
    vocab, argv = int(argv[i + 1]), argv[:i] + argv[i + 2 :]
    base = tempfile.mkdtemp(prefix="gpu_checks_base_")
    try:
        build_offline_corpus(os.path.join(base, "base_data"), num_train_shards=1, max_docs=OFFLINE_DOCS)
        pair_tokenizer(vocab).save(os.path.join(base, "tokenizer"))
        run_dir = os.path.join(base, "run")
        cmd = [sys.executable, "-m", "scripts.base_train", "--run", run_dir, *argv]
        print("$ " + " ".join(cmd), flush=True)
        t0 = time.time()
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=dict(os.environ, NANOCHAT_BASE_DIR=base),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        lines = []
        for line in proc.stdout:  # into the stage's log as it comes
            print(line, end="", flush=True)
            lines.append(line.strip())
        rc = proc.wait()
        seconds = time.time() - t0
        rows = [json.loads(line) for step, line in metrics_lines(metrics_path(run_dir)) if step is not None]
        config = read_config(run_dir, missing_ok=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    steps, tokens = [], 0
    for row in rows:
        if row.get("step") and row.get("tok_per_sec"):
            mod = row.get("mod", {})
            steps.append(
                {
                    "step": row["step"],
                    "ms": 1000 * (row["tokens"] - tokens) / row["tok_per_sec"],
                    "train_loss": row["train_loss"],
                    "skip_attn": mod.get("skip_attn"),
                    "skip_mlp": mod.get("skip_mlp"),
                    "mfu": row.get("mfu"),
                    # where the step's time went (nanochat/step_timer.py's phases)
                    "parts_ms": {k: 1000 * v for k, v in row.get("time", {}).items()},
                }
            )
            tokens = row["tokens"]
    peak = next((float(l.split()[2]) for l in lines if l.startswith("peak memory ")), None)
    d = {
        "base_train_exit": rc,
        "seconds": seconds,
        "argv": argv,
        "vocab_size": vocab,
        "fp8_layers": config.get("fp8_layers"),
        "attention": (config.get("attention") or {}).get("kernel"),
        "peak_mem_gib": peak,
        # nanochat/memory.py's plan of the run, made before it started
        "predicted_peak_gib": (config.get("memory") or {}).get("peak_gib"),
        "steps": steps,
    }
    with open(json_path, "w") as f:
        json.dump(d, f, indent=1)
    why = (
        f"base_train exit {rc}: {lines[-1] if lines else ''}"
        if rc != 0
        else "--fp8 ran no layer in fp8"
        if "--fp8" in argv and not d["fp8_layers"]
        else "--mod-rate skipped no token"
        if "--mod-rate" in argv and not any(s["skip_mlp"] or s["skip_attn"] for s in steps)
        else None
    )
    if why:
        sys.exit(f"error: base_train stage: {why}")


# ---------------------------------------------------------------------------
# figures: one short text per stage, and the headline block


def kernel_figures(d):
    skipped = [t["name"] for t in d["tests"] if t["result"] == "skipped"]
    return f"{d['passed']} passed ({d['cuda_passed']} CUDA), {d['skipped']} skipped" + (
        f": {', '.join(skipped)}" if skipped else ""
    )


def attention_figures(d):
    cells = [f"{r['kernel']} {r['window']} {r['fwd_bwd_ms']:.2f} ms" for r in d["results"]]
    if d.get("window_vs_full"):  # the claim: an S window costs no more than the full row
        cells.append("S / L " + ", ".join(f"{k} {x:.2f}×" for k, x in d["window_vs_full"].items()))
    cells += [
        f"{x['window']}: {x.get('kernel', 'fa3')} {x['speedup']:.2f}× as fast as {x.get('vs', 'sdpa')}, |difference| "
        f"out {x['out']:.1e}, grads {max(x['grad_q'], x['grad_k'], x['grad_v']):.1e}"
        for x in d.get("vs_sdpa", d["fa3_vs_sdpa"])
    ]
    skipped = {k: why for k, why in d.get("kernels", {}).items() if why != "timed"}
    if skipped:
        cells.append("not run: " + ", ".join(f"{k} ({why})" for k, why in skipped.items()))
    elif not d.get("vs_sdpa", d["fa3_vs_sdpa"]):
        cells.append(f"FA3 not run: {d['attention']['reason']}")
    if "timed_ms" in d["attention"]:  # auto chose by timing: what, and why
        cells.append(f"--attn auto chose {d['attention']['kernel']}: {d['attention']['reason']}")
    c = d.get("compile")
    if c:
        cells.append(
            f"{c['kernel']} compiled: "
            + (
                f"{'fullgraph' if c['fullgraph'] else 'graph break'}, {c['compile_s']:.0f} s, {c['fwd_bwd_ms']:.2f} ms"
                if "compile_s" in c
                else f"failed: {c['error']}"
            )
        )
    return "fwd+bwd " + "; ".join(cells)


def op_figures(d):
    op = d["op"]
    ms = lambda r, d: f" {r[d + '_ms']:.3f} ms," if d + "_ms" in r else ""  # a JSON from before had GB/s alone
    cells = [
        f"{impl} fwd{ms(r, 'forward')} {r['forward_gbps']:.0f} GB/s ({100 * r['forward_of_copy']:.0f}%), "
        f"bwd{ms(r, 'backward')} {r['backward_gbps']:.0f} GB/s ({100 * r['backward_of_copy']:.0f}%)"
        for impl, r in op["impls"].items()
    ]
    if op.get("fused_vs_compiled"):
        x = op["fused_vs_compiled"]
        cells.append(f"fused vs compiled (Inductor): fwd {x['forward']:.2f}×, bwd {x['backward']:.2f}× as fast")
    sweep = op.get("rows_per_program")
    if sweep:
        cells.append(rows_per_program_figures(sweep))
    bytes_row = (
        f" (a row: fwd {op['forward_bytes_per_row']:,} B, bwd {op['backward_bytes_per_row']:,} B)"
        if "forward_bytes_per_row" in op
        else ""
    )
    return f"copy {op['copy_gbps']:.0f} GB/s{bytes_row}; " + "; ".join(cells)


def rows_per_program_figures(sweep):
    gbps = sweep["backward_gbps"]
    return (
        f"fused backward alone by rows per program: best {sweep['best']} ({gbps[str(sweep['best'])]:.0f} GB/s), "
        f"{sweep['gain_over_default']:.3f}× the default {sweep['default']} ({gbps[str(sweep['default'])]:.0f} GB/s); "
        + ", ".join(f"{k}: {v:.0f}" for k, v in gbps.items())
    )


def train_figures(d):
    s = d["steps"]
    if not s:
        return "no step logged"
    times = ", ".join(f"{x['ms']:.0f}" for x in s[1:])
    skip = lambda k: ", ".join(f"{100 * x[k]:.0f}" for x in s if x[k] is not None) or "-"
    mod = any(x["skip_attn"] is not None or x["skip_mlp"] is not None for x in s)
    fp8 = f", fp8 on {d['fp8_layers']} layers" if d["fp8_layers"] else ""
    return (
        f"{len(s)} steps{fp8}, attention {d['attention']}: step 1 {s[0]['ms'] / 1000:.1f} s (compiles), then {times} ms"
        + (f"; skipped % attn {skip('skip_attn')}, mlp {skip('skip_mlp')}" if mod else "")
        + (f"; MFU {100 * s[-1]['mfu']:.1f}%" if s[-1].get("mfu") else "")
        + (f"; peak {d['peak_mem_gib']:.1f} GiB" if d["peak_mem_gib"] else "")
    )


def against_bench(d, step):
    """base_train's median step after the first against the step stage's nag:fused step (the bench's loop: random
    tokens already on the device), within NAG_TRAIN_WITHIN or not, and where base_train's later steps' time went."""
    from nanochat.step_timer import LABELS

    later = d["steps"][1:]
    bench = next((r for r in (step or {}).get("results", []) if r["arch"] == "nag:fused"), None)
    if not later:
        return "no step after the first to compare"
    if bench is None:
        return "no nag:fused step from the step stage to compare with (it failed or was skipped)"
    ms = statistics.median(x["ms"] for x in later)
    ratio = ms / bench["step_ms"]
    ok = abs(ratio - 1) <= NAG_TRAIN_WITHIN
    parts = {k: sum(x.get("parts_ms", {}).get(k, 0.0) for x in later) / len(later) for k in LABELS}
    return (
        f"a step after the first {ms:.1f} ms (median; on average "
        + ", ".join(f"{LABELS[k]} {v:.1f}" for k, v in parts.items() if v > 0)
        + f" ms) = {ratio:.3f}× the step stage's nag:fused {bench['step_ms']:.1f} ms: "
        f"{'PASS, within' if ok else 'FAIL, outside'} {100 * NAG_TRAIN_WITHIN:.0f}%"
    )


def fp8_mod_figures(d):
    return f"{train_figures(d)}; {fp8_mod_verdict(d)}"


def fp8_mod_verdict(d):
    """base_train --fp8 --mod-rate 0.2's median step after the first against FP8_MOD_STEP_MS."""
    later = [x["ms"] for x in d["steps"][1:]]
    if not later:
        return "no step after the first to time"
    ms = statistics.median(later)
    return (
        f"a step after the first {ms:.0f} ms (median): {'PASS' if ms <= FP8_MOD_STEP_MS else 'FAIL'}, target at most "
        f"{FP8_MOD_STEP_MS} ms (1,183 and 1,012 eager on the first H200)"
    )


def verdict(c):
    """A target of scripts/bench/mod.py's JSON: what, the ratio, PASS or FAIL."""
    return f"{c['what']} {c['value']:.3f}× ({'PASS' if c['ok'] else 'FAIL'}, target at most {c['target']:.2f}×)"


def mod_figures(d):
    """The mod stages' line: each variant's step time, peak memory, compile seconds, realised skip rates and overflow
    (the share of tokens over the threshold that did not fit a row's capacity), then each target, PASS or FAIL."""
    cells = []
    for r in d["results"]:
        name = "full depth" if r["blocks"] == "none" else f"{r['blocks']} {100 * r['rate']:.0f}%"
        mod = r["blocks"] != "none"
        cells.append(
            f"{name}{' fp8' if r['precision'] == 'fp8' else ''} {r['step_ms']:.1f} ms"
            + (f", {r['peak_mem_gib']:.1f} GiB" if r["peak_mem_gib"] is not None else "")
            + f", compile {r['compile_s']:.0f} s ({r['graphs']} graph(s)"
            + (f", {r['later_graphs']} more later" if r["later_graphs"] else "")
            + ")"
            + (f", skipped attn {100 * r['skip_attn']:.0f}% mlp {100 * r['skip_mlp']:.0f}%" if mod else "")
            + (
                f", overflow attn {100 * r.get('overflow_attn', 0):.1f}% mlp {100 * r.get('overflow_mlp', 0):.1f}%"
                if mod and "overflow_rows" in r
                else ""
            )
        )
    cells += [verdict(c) for c in d["claims"]]
    return f"depth {d['depth']} × {d['dim']}, {'compiled' if d['compiled'] else 'eager'}: " + "; ".join(cells)


def nag_train_figures(d, step):
    return f"{train_figures(d)}; {against_bench(d, step)}"


def compile_figures(r):
    """What a variant compiled in its first step and how long it took, the model and the optimizer apart."""
    return (
        f"model {r['model_compile_s']:.0f} s ({r['model_graphs']} graph(s)), "
        f"optimizer {r['optim_compile_s']:.0f} s ({r['optim_graphs']} graph(s)"
        + (f": {', '.join(r['optim_compiled'])}" if r["optim_compiled"] and r["optim_graphs"] else "")
        + ")"
        + (f", {r['later_graphs']} recompiled later" if r["later_graphs"] else "")
    )


def step_figures(d):
    rs = d["results"]
    cells = [
        f"{r['arch']}{' fp8' if r.get('precision') == 'fp8' else ''}"
        f"{' (2 host reads)' if r.get('host_reads') == 2 else ''} {r['step_ms']:.1f} ms"
        + (f" (fwd+bwd {r['fwd_bwd_ms']:.1f}, optimizer {r['optim_ms']:.1f})" if "optim_ms" in r else "")
        + f", {r['peak_mem_gib']:.1f} GiB, compile{' (cold)' if r['fresh_cache'] else ''} {compile_figures(r)}"
        + (f", MFU {100 * r['mfu']:.1f}%" if "mfu" in r else "")
        for r in rs
    ]
    cells += [
        f"{q['what']}: {q['step_time']:.3f}× time, {q['peak_mem']:.3f}× memory"
        + (f": {q['faster']}" if "faster" in q else "")
        for q in d["ratios"]
    ]
    return f"depth {rs[0]['depth']} × {rs[0]['dim']}: " + "; ".join(cells)


MEMORY_WITHIN = 0.10  # the memory plan's claim: its peak within 10 % of torch.cuda.max_memory_allocated


def predicted_peak(argv):
    """The peak GiB that base_train's plan of argv predicts (nanochat/memory.py), for a GPU."""
    from nag.archs import plan_for
    from nag.train_flags import parse_args

    args = parse_args([*argv, "--gpu-memory", "1000"])  # the peak does not depend on the GPU's size
    return plan_for(args, 32768, 1, "cuda").memory.peak


def memory_plan_figures(step, nt, fm):
    """Predicted against measured peak for the step stage's models and the base_train stages' runs."""
    cells = []
    for r in (step or {}).get("results", []):
        arch, _, impl = r["arch"].partition(":")
        argv = ["--arch", arch, *(["--nag-impl", impl] if impl else []), "--depth", str(r["depth"])]
        # the bench's shape flags that base_train also takes (all but --vocab-size)
        argv += [*PUBLISHED_SHAPE[:8], "--total-batch-size", str(r["tokens_per_step"]), "--num-iterations", "1"]
        argv += ["--fp8"] if r.get("precision") == "fp8" else []
        cells.append((r["arch"], predicted_peak(argv), r["peak_mem_gib"]))
    for name, d in (("base_train nag", nt), ("base_train fp8 MoD", fm)):
        if d and d.get("peak_mem_gib") and d.get("predicted_peak_gib"):
            cells.append((name, d["predicted_peak_gib"], d["peak_mem_gib"]))
    return "; ".join(
        f"{what} {p:.2f} predicted / {m:.2f} GiB measured ({100 * (p / m - 1):+.1f}%, "
        f"{'within' if abs(p / m - 1) <= MEMORY_WITHIN else 'OUTSIDE'} {MEMORY_WITHIN:.0%})"
        for what, p, m in cells
    )


def load(out, name):
    try:
        with open(os.path.join(out, name + ".json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def result(d, arch, mode="on"):
    return next((r for r in (d or {}).get("results", []) if r["arch"] == arch and r["compile"] == mode), None)


def to_depth(lo, hi, key, depth=64):
    """hi[key] carried linearly to `depth` along the slope from lo to hi (two depths of one width)."""
    slope = (hi[key] - lo[key]) / (hi["depth"] - lo["depth"])
    return hi[key] + (depth - hi["depth"]) * slope


def headline(out):
    """The figures to quote (README, docs/LOG.md), from whichever stage JSONs exist."""
    lines = []
    step, depth, blocks, mfu = (load(out, n) for n in ("step", "depth", "blocks", "mfu"))
    archs = ("gpt", "nag:fused")
    g8, n8 = (result(step, a) for a in archs)
    g4, n4 = (result(depth, a) for a in archs)
    g64 = result(load(out, "published_gpt"), "gpt")
    n64 = result(load(out, "published_nag"), "nag:fused")
    impls = [r for r in (step or {}).get("results", []) if r["arch"].startswith("nag:")]
    picked = next((q["faster"] for q in (step or {}).get("ratios", []) if "faster" in q), None)
    if picked:
        from nag.model import default_impl

        best = min(impls, key=lambda r: r["step_ms"])
        lines.append(
            f"- NAG implementation the figures favour for training, by step time: {best['arch'].partition(':')[2]} "
            f"(step: depth {best['depth']} × {best['dim']}, {best['tokens_per_step']:,} tokens, compiled whole); "
            f"{picked}; nag/model.py's default on CUDA: {default_impl('cuda')}"
        )
    if g8 and n8:
        lines.append(
            f"- NAG / GPT at the published shape (640 wide, 16 × 2048 tokens, compiled whole), depth 8: "
            f"step time {n8['step_ms'] / g8['step_ms']:.3f}×, peak memory "
            f"{n8['peak_mem_gib'] / g8['peak_mem_gib']:.3f}× (GPT "
            f"{g8['step_ms']:.1f} ms, {g8['peak_mem_gib']:.1f} GiB)"
        )
    if g8 and n8 and g4 and n4:
        t = {a: to_depth(lo, hi, "step_ms") for a, lo, hi in (("gpt", g4, g8), ("nag", n4, n8))}
        m = {a: to_depth(lo, hi, "peak_mem_gib") for a, lo, hi in (("gpt", g4, g8), ("nag", n4, n8))}
        flops = to_depth(g4, g8, "flops_per_token")
        lines.append(
            f"- the same at 64 blocks, carried linearly from depths 4 and 8 (per-layer cost = the difference / 4): "
            f"step time {t['nag'] / t['gpt']:.3f}× (GPT {t['gpt']:.0f} ms, NAG {t['nag']:.0f} ms), "
            f"peak memory {m['nag'] / m['gpt']:.3f}× (GPT {m['gpt']:.1f} GiB, NAG {m['nag']:.1f} GiB)"
            + (
                f", GPT MFU {100 * flops * g8['tokens_per_step'] / (t['gpt'] / 1e3) / g8['peak_flops']:.1f}%"
                if g8.get("peak_flops")
                else ""
            )
        )
    if g64 and n64:
        lines.append(
            f"- measured at 64 blocks: step time {n64['step_ms'] / g64['step_ms']:.3f}× (GPT {g64['step_ms']:.0f} ms, "
            f"NAG {n64['step_ms']:.0f} ms), peak memory {n64['peak_mem_gib'] / g64['peak_mem_gib']:.3f}×"
            + (f", GPT MFU {100 * g64['mfu']:.1f}%" if "mfu" in g64 else "")
        )
    mod = load(out, "mod")
    if mod and mod["claims"]:
        ref = mod["results"][0]
        lines.append(
            f"- MoD against issue 48's targets (NAG, both blocks, depth {mod['depth']} × {mod['dim']}, "
            f"{mod['tokens_per_step']:,} tokens, {'compiled whole' if mod['compiled'] else 'eager'}; full depth "
            f"{ref['step_ms']:.1f} ms"
            + (f", {ref['peak_mem_gib']:.1f} GiB" if ref["peak_mem_gib"] is not None else "")
            + "): "
            + "; ".join(verdict(c) for c in mod["claims"])
        )
    attn = load(out, "attention")
    if attn and attn.get("window_vs_full"):
        lines.append(
            "- attention alone, 16 × 2048, 5 heads × 128, forward + backward of the S window against full causal: "
            + ", ".join(f"{k} {x:.2f}×" for k, x in attn["window_vs_full"].items())
            + f" (at most 1 wanted); --attn auto chose {attn['attention']['kernel']} ({attn['attention']['reason']})"
        )
    for x in (attn or {}).get("fa3_vs_sdpa", []):
        ms = {r["kernel"]: r["fwd_bwd_ms"] for r in attn["results"] if r["window"] == x["window"]}
        lines.append(
            f"- attention alone, window {x['window']}, 16 × 2048, 5 heads × 128: FA3 {ms['fa3']:.2f} ms, SDPA "
            f"{ms['sdpa']:.2f} ms forward + backward ({x['speedup']:.2f}×); outputs differ by at most {x['out']:.1e}"
        )
    op = (load(out, "branch_op") or {}).get("op")
    if op and "fused" in op["impls"]:
        f = op["impls"]["fused"]
        lines.append(
            f"- branch op, fused, {op['rows']:,} rows × {op['dim']} {op['dtype']}: forward {f['forward_gbps']:.0f} "
            f"GB/s ({100 * f['forward_of_copy']:.0f}% of copy), backward {f['backward_gbps']:.0f} GB/s "
            f"({100 * f['backward_of_copy']:.0f}% of copy); copy {op['copy_gbps']:.0f} GB/s"
        )
    if op and op.get("rows_per_program"):
        lines.append(f"- {rows_per_program_figures(op['rows_per_program'])} (GB/s; nag.kernels' default left as it is)")
    d20 = result(mfu, "gpt")
    if d20:
        lines.append(
            f"- GPT d20-like (20 × {d20['dim']}, {d20['tokens_per_step']:,} tokens per step), compiled: "
            + (f"MFU {100 * d20['mfu']:.1f}%, " if "mfu" in d20 else "")
            + f"{d20['step_ms']:.0f} ms per step"
        )
    nt = load(out, "base_train")
    if nt and nt["steps"]:
        lines.append(
            f"- base_train --arch nag (fused, SDPA) at the step stage's shape, compiled: {against_bench(nt, step)}"
        )
    fm = load(out, "fp8_mod")
    if fm and len(fm["steps"]) > 1:
        lines.append(
            f"- base_train --fp8 --mod-rate 0.2 (NAG-MoD) at width 640, depth 8, compiled: {len(fm['steps'])} steps "
            f"ran, the first {fm['steps'][0]['ms'] / 1000:.0f} s, {fm['fp8_layers']} layers in fp8; "
            + fp8_mod_verdict(fm)
        )
    planned = memory_plan_figures(step, nt, fm)
    if planned:
        lines.append(f"- memory plan (nanochat/memory.py) against the measured peaks: {planned}")
    cold = [r for r in (g4, n4, g8, n8, d20, g64, n64) if r and r["fresh_cache"]]
    if cold:
        lines.append(
            "- cold compile (empty caches; first step minus a timed one): "
            + "; ".join(f"depth {r['depth']} × {r['dim']} {r['arch']}: {compile_figures(r)}" for r in cold)
        )
    for depth, per_block_run, wholes in ((8, blocks, (g8, n8)), (64, load(out, "published_blocks"), (g64, n64))):
        for arch, whole in zip(archs, wholes):
            per_block = result(per_block_run, arch, "blocks")
            if per_block and whole:
                ratio = per_block["step_ms"] / whole["step_ms"]
                lines.append(
                    f"- {arch} compiled per block / whole, depth {depth}: step time {ratio:.3f}× "
                    f"({'within' if ratio <= 1.02 else 'outside'} 2%), peak memory "
                    f"{per_block['peak_mem_gib'] / whole['peak_mem_gib']:.3f}×, model compile "
                    f"{per_block['model_compile_s']:.0f} s ({per_block['model_graphs']} graph(s)) vs "
                    f"{whole['model_compile_s']:.0f} s, the run's caches shared"
                )
    return lines or ["- no figures: every benchmark stage failed"]


# ---------------------------------------------------------------------------


def environment():
    from nanochat.common import nvidia_smi
    import torch
    import triton

    env = {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "python": sys.version.split()[0],
        "gpu": torch.cuda.get_device_name(),
        "capability": list(torch.cuda.get_device_capability()),
        "gpu_memory_gib": torch.cuda.get_device_properties(0).total_memory / 2**30,
        "gpus": torch.cuda.device_count(),
    }
    _, env["driver"], env["driver_cuda"] = nvidia_smi()  # the driver's version and the newest CUDA it runs
    return env


def dry_run(plan, budget):
    print(f"{'stage':16s} {'limit':>7s} {'expected':>8s}  {'caches':6s}  what")
    for st in plan:
        print(f"{st.name:16s} {st.timeout:5.0f} s {st.expect:6.0f} s  {'empty' if st.cold else 'shared':6s}  {st.what}")
    expected = sum(st.expect for st in plan)
    print(
        f"expected {expected:.0f} s in all, {100 * expected / budget:.0f}% of the {budget:.0f} s budget (planned: at "
        f"most {100 * PLANNED:.0f}% for --quick); a stage starts "
        "only while its expected time is left, else it is SKIPPED"
    )
    print(f"writes {len(OUTPUTS)} files, all at the top of $OUT (else --out), none in a folder: {', '.join(OUTPUTS)}")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"the stages a first GPU slot must answer, in {QUICK_BUDGET // 60} minutes on one GPU",
    )
    p.add_argument("--out", type=str, default="", help="output folder ($OUT wins when set; default gpu_checks/)")
    p.add_argument(
        "--budget",
        type=float,
        default=None,
        help=f"seconds for the whole run, positive (default {QUICK_BUDGET} with --quick, else {FULL_BUDGET})",
    )
    p.add_argument("--dry-run", action="store_true", help="print the stages and stop (no GPU needed)")
    p.add_argument("--kernel-tests", type=str, default=None, help=argparse.SUPPRESS)
    # JSON, then base_train's flags
    p.add_argument("--base-train", nargs=argparse.REMAINDER, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def refusal(args):
    """The one `error:` line for flags no run can use (the wording of nanochat.common's number rules), else None."""
    if args.budget is not None and not (math.isfinite(args.budget) and args.budget > 0):
        return f"--budget must be positive; got {args.budget:g}"
    return None


def eval_bundle(quick):
    """$EVAL_BUNDLE for the full run's core_batching stage: the folder, or None. Set to what is not an eval bundle
    (a folder with core.yaml, as nanochat.core_eval reads it), one line on stderr says so and that the stage is left
    out; --quick has no such stage."""
    bundle = os.environ.get("EVAL_BUNDLE", "")
    if quick or not bundle:
        return None
    if os.path.isfile(os.path.join(bundle, "core.yaml")):
        return bundle
    why = "has no core.yaml" if os.path.isdir(bundle) else "is not a folder"
    print(f"note: EVAL_BUNDLE={bundle} {why}: the core_batching stage is left out", file=sys.stderr, flush=True)
    return None


def main(argv=None):
    t_start = time.time()
    args = parse(argv)
    if args.kernel_tests:
        return kernel_tests(args.kernel_tests)
    if args.base_train is not None:
        from nanochat.common import exit_on_user_error

        with exit_on_user_error():
            return base_train_stage(args.base_train[0], args.base_train[1:])
    if why := refusal(args):
        print(f"error: {why}", file=sys.stderr)
        sys.exit(1)
    budget = args.budget if args.budget is not None else QUICK_BUDGET if args.quick else FULL_BUDGET
    plan = stages(args.quick, eval_bundle(args.quick))
    if args.dry_run:
        return dry_run(plan, budget)
    import torch

    if not torch.cuda.is_available():
        print(
            f"error: no GPU: torch {torch.__version__} (CUDA build {torch.version.cuda or 'none'}) at {sys.executable} "
            "sees no CUDA device; run this on a GPU node, with PYTHON= "
            "pointing at a CUDA build of torch if .venv has none",
            file=sys.stderr,
        )
        sys.exit(1)
    out = os.environ.get("OUT") or args.out or "gpu_checks"
    os.makedirs(out, exist_ok=True)
    out = os.path.abspath(out)
    for name in OUTPUTS:  # an earlier run's files must not stand in for this one's
        if os.path.exists(os.path.join(out, name)):
            os.remove(os.path.join(out, name))
    work = tempfile.mkdtemp(prefix="gpu_checks_work_")  # the stages' JSONs and logs; out gets them merged and archived
    env = environment()
    with open(os.path.join(work, "env.json"), "w") as f:
        json.dump(env, f, indent=1)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(
            f"# GPU checks{' (quick)' if args.quick else ''}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n\n"
            f"{env['gpu']}, driver {env['driver']}, torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}; "
            f"budget {budget:.0f} s\n\n| stage | result | seconds | figures |\n|---|---|---:|---|\n"
        )
    print(
        f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, "
        f"CUDA {env['cuda']}, driver {env['driver']}; writing {out}",
        flush=True,
    )
    failed = run_stages(plan, work, budget - (time.time() - t_start), out, env)  # the budget counts from the start
    with open(os.path.join(out, "summary.md"), "a") as f:
        f.write("\n## Headline figures\n\n" + "\n".join(headline(work)) + "\n")
        if failed:
            f.write(f"\nFAILED: {', '.join(failed)} (logs: logs.tar.gz)\n")
    print(open(os.path.join(out, "summary.md")).read())
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
