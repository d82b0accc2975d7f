"""The layout's rules (docs/design.md §1), read from the source: who may import what.

No command importing another, the layers below the
commands importing none of them, the baseline free of NAG. Each checker takes a root folder, so that a fake tree
shows it catches what it should and nothing else, whatever today's tree holds."""

import ast
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# what a driver may call of a command: its work (from flags read through nag/train_flags.py or the command's own
# parser) and its command line; a driver or benchmark reads base_train's flags through the library, never the command
ENTRIES = {"main", "train", "evaluate"}
DRIVERS = ("scripts/speedrun.py", "scripts/experiments/")
BENCHMARKS = ("scripts/bench/",)
# every use one file under scripts/ may make of another module there: (files, module, names; None: any name)
ALLOWED = [
    (DRIVERS, "scripts.base_train", ENTRIES),
    (DRIVERS, "scripts.base_eval", ENTRIES | {"build_parser"}),  # evaluate's namespace: its flags are its own
    (DRIVERS, "scripts.speedrun", {"main"}),  # failures.py runs speedrun's plan in-process
    (DRIVERS, "scripts.experiments", None),  # the drivers' shared set-up, not a command
    (BENCHMARKS, "scripts.bench.models", None),  # the benchmarks' shared library, not a command
    # a GPU's state as check_cuda reads it (gpu_checks now takes it from nanochat.common)
    (BENCHMARKS, "scripts.check_cuda", {"nvidia_smi"}),
    # its step timing
    (("scripts/bench/nag.py",), "scripts.bench.train", {"benchmark", "parse", "ratios", "print_ratios"}),
    # its counting rule of kernel launches, for the optimizer's step
    (("scripts/bench/optim.py",), "scripts.bench.nag", {"LaunchCounter"}),
]
LAYERS = ("nanochat", "nag", "analysis")  # below the commands: they import none of scripts/


def py_files(root, folder):
    for dirpath, dirnames, names in os.walk(os.path.join(root, folder)):
        dirnames.sort()
        for name in sorted(names):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                yield os.path.relpath(path, root).replace(os.sep, "/"), open(path, encoding="utf-8").read()


def module_of(rel):
    return rel[:-3].replace("/", ".").removesuffix(".__init__")


def is_module(root, module):
    path = os.path.join(root, *module.split("."))
    return os.path.exists(path + ".py") or os.path.exists(os.path.join(path, "__init__.py"))


def absolute(node, rel):
    """The module an ImportFrom names, a relative one (`from . import x`) resolved against the file's package."""
    if not node.level:
        return node.module
    package = rel[:-3].split("/")[: -node.level]
    return ".".join(package + ([node.module] if node.module else []))


def dotted(node):
    """`a.b.c` of a chain of attributes on a name, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted(node.value)
        return base and f"{base}.{node.attr}"
    return None


def imported(tree, rel, root):
    """(line, module, names used from it) of every import of a scripts module. A module imported whole (`from scripts
    import base_train`, `import scripts.bench.models`) is followed to the attributes read from it; no attribute read
    gives an empty set (the module itself is used)."""
    bound, out = {}, []  # name in this file -> the module it stands for
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = absolute(node, rel)
            if not module or module.split(".")[0] != "scripts":
                continue
            for a in node.names:
                # from scripts(.bench) import X: a module, used through its name
                if is_module(root, f"{module}.{a.name}"):
                    bound[a.asname or a.name] = f"{module}.{a.name}"
                    out.append((node.lineno, f"{module}.{a.name}", None))
                else:
                    out.append((node.lineno, module, {a.name}))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "scripts":
                    bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
                    out.append((node.lineno, a.name, None))
    uses = set()
    for node in ast.walk(tree):
        chain = dotted(node) if isinstance(node, ast.Attribute) else None
        head = chain and chain.split(".")[0]
        if head in bound:
            uses.add(bound[head] + chain[len(head) :])
    return [
        (
            line,
            module,
            names
            if names is not None
            else {u[len(module) + 1 :].split(".")[0] for u in uses if u.startswith(module + ".")},
        )
        for line, module, names in out
    ]


def disallowed(rel, module, names):
    """The names of module that rel may not use (all of them, or {""} for the module itself, when no rule covers it)."""
    names = names or {""}
    for files, allowed_module, allowed in ALLOWED:
        if module == allowed_module and rel.startswith(files):
            names = set() if allowed is None else names - allowed
    return names


def command_import_problems(root):
    """Every use in scripts/ of another scripts module beyond ALLOWED, and every import of scripts/ from the layers
    below."""
    problems = []
    for rel, text in py_files(root, "scripts"):
        for line, module, names in imported(ast.parse(text), rel, root):
            bad = set() if module == module_of(rel) else disallowed(rel, module, names)
            if bad:
                what = ", ".join(f"{module}.{n}" if n else module for n in sorted(bad))
                problems.append(
                    f"{rel}:{line} imports {what}: a command may use "
                    "another only as ALLOWED says (tests/test_layout.py)"
                )
    for layer in LAYERS:
        for rel, text in py_files(root, layer):
            for node in ast.walk(ast.parse(text)):
                for m in imports_of(node):
                    if m.split(".")[0] == "scripts":
                        problems.append(f"{rel}:{node.lineno} imports {m}: {layer}/ stands below the commands")
    return problems


def imports_of(node):
    if isinstance(node, ast.ImportFrom) and node.module and not node.level:
        return [node.module]
    return [a.name for a in node.names] if isinstance(node, ast.Import) else []


# NAG by name: the word, nag_ in identifiers, NAGGPT / NAGConfig, --nag- flags;
# the project's name nag-chat is not the arch
NAG_WORD = re.compile(r"(?i:\bnag\b(?!-chat\b)|(?<![a-z])nag_)|NAG[A-Z]")


def baseline_problems(root):
    """Every line of a .py file under nanochat/ that names NAG, and every import there of nag/ or analysis/."""
    problems = []
    for rel, text in py_files(root, "nanochat"):
        for i, line in enumerate(text.splitlines(), 1):
            if NAG_WORD.search(line):
                problems.append(f"{rel}:{i} names NAG: {line.strip()[:100]}")
        for node in ast.walk(ast.parse(text)):
            for m in imports_of(node):
                if m.split(".")[0] in ("nag", "analysis"):
                    problems.append(f"{rel}:{node.lineno} imports {m}: the baseline imports nothing above it")
    return problems


def test_no_command_imports_another():
    problems = command_import_problems(REPO)
    assert not problems, "\n" + "\n".join(problems)


def test_the_baseline_names_no_nag():
    problems = baseline_problems(REPO)
    assert not problems, "\n" + "\n".join(problems)


def write(root, files):
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def where(problems):
    return sorted(p.split(" ")[0] for p in problems)


def test_the_command_checker_catches_what_it_should(tmp_path):
    write(
        tmp_path,
        {
            "scripts/__init__.py": "",
            "scripts/base_train.py": "def train(args): pass\ndef make_plan(): pass\n",
            "scripts/check_cuda.py": "def nvidia_smi(): pass\ndef probe(): pass\n",
            "scripts/compare.py": "from scripts.base_train import make_plan\n",  # a command's internals
            # an entry, but not from a driver
            "scripts/sample.py": "from scripts import base_train\nbase_train.train(None)\n",
            # a driver's entry: fine; its flags: through nag/train_flags.py
            "scripts/speedrun.py": "from scripts import base_train\nbase_train.train(None)\nbase_train.parse_args([])\n"
            "def plan(): pass\n",
            "scripts/experiments/__init__.py": "from scripts import base_train\nbase_train.main([])\n",  # fine
            "scripts/experiments/sweep.py": "import scripts.base_train\nscripts.base_train.make_plan()\n"
            "from scripts.experiments import prepare\nfrom scripts.speedrun import main\n"
            "from scripts import speedrun as s\ns.plan()\n",
            "scripts/bench/__init__.py": "",
            "scripts/bench/models.py": "from scripts.base_train import parse_args\n",  # nag/train_flags.py's now
            "scripts/bench/train.py": "from scripts.bench import models\nfrom scripts.base_train import build_parser\n"
            "def benchmark(): pass\ndef run_variant(): pass\n",
            "scripts/bench/nag.py": "from . import train as bench_train\nbench_train.benchmark()\n"
            "bench_train.run_variant()\n"
            "from scripts.check_cuda import nvidia_smi\n",
            "scripts/bench/gpu.py": "from scripts.check_cuda import probe\nimport scripts.bench.models as m\n"
            "m.build()\n",
            "nag/archs.py": "from scripts.base_train import train\n",
            "analysis/run.py": "import torch\nfrom nanochat.gpt import GPT\n",
            "nanochat/gpt.py": "import scripts.bench.models\n",
        },
    )
    got = command_import_problems(tmp_path)
    assert where(got) == sorted(
        [
            "scripts/compare.py:1",
            "scripts/sample.py:1",
            "scripts/experiments/sweep.py:1",
            "scripts/experiments/sweep.py:5",
            "scripts/speedrun.py:1",
            "scripts/bench/models.py:1",
            "scripts/bench/train.py:2",
            "scripts/bench/nag.py:1",
            "scripts/bench/gpu.py:1",
            "nag/archs.py:1",
            "nanochat/gpt.py:1",
        ]
    ), got
    text = "\n".join(got)
    assert (
        "scripts.base_train.make_plan" in text
        and "scripts.speedrun.plan" in text
        and "scripts.check_cuda.probe" in text
    )
    nag_line = next(p for p in got if p.startswith("scripts/bench/nag.py"))
    assert "scripts.bench.train.run_variant" in nag_line and "benchmark" not in nag_line


def test_the_baseline_checker_catches_what_it_should(tmp_path):
    write(
        tmp_path,
        {
            "nanochat/gpt.py": "import torch\n# the NAG branch lives elsewhere\nPROJECT = 'nag-chat'\n",
            "nanochat/plan.py": "from nag.archs import ARCHS\nx = 1  # --nag-gate-lr\nimport analysis.run\n",
            "nanochat/ok.py": "# snag, nagging, snag_it, Nagoya and the nag-chat project are not the arch\n"
            "import nanochat.gpt\n",
            "nanochat/conf.py": "cfg = NAGConfig()\nm = NAGGPT\nuse_nag_gates = 1\n",
            "nanochat/notes.md": "NAG in a file that is not Python\n",
        },
    )
    got = baseline_problems(tmp_path)
    assert where(got) == sorted(
        [
            "nanochat/conf.py:1",
            "nanochat/conf.py:2",
            "nanochat/conf.py:3",
            "nanochat/gpt.py:2",
            "nanochat/plan.py:1",
            "nanochat/plan.py:1",
            "nanochat/plan.py:2",
            "nanochat/plan.py:3",
        ]
    ), got


# ---------------------------------------------------------------------------
# one owner per fact: file names of a run, arch names, base_train's flags, module openings

SOURCES = ("nanochat", "nag", "scripts", "analysis")
# a run's and a tokenizer's file names, each spelled only by the module that reads and writes it
FILE_OWNERS = {
    "config.json": "nanochat/run_dir.py",
    "eval.json": "nanochat/run_dir.py",
    "metrics.jsonl": "nanochat/run_dir.py",
    "tokenizer.pkl": "nanochat/tokenizer.py",
    "token_bytes.pt": "nanochat/tokenizer.py",
}
# where an arch's name may be spelled: the registry, the model class naming itself (`arch = "..."`), the presets'
# data, the exported Hugging Face code (it must run without this repo) and the benchmarks' variants (arch × kernel)
ARCH_NAME_PLACES = ("nag/archs.py", "nag/presets.py", "nag/hf/", "scripts/bench/")
MAX_OWN_FLAGS = 37  # base_train's own flags (the archs' come from nag/archs.py); docs/runs.md says why each exists
MAX_OPENING = 100  # characters in a module's opening line


def string_constants(tree):
    """(line, value) of every str constant, but not the value of a class's `arch = "..."` attribute."""
    named = {
        id(n.value)
        for n in ast.walk(tree)
        if isinstance(n, ast.ClassDef)
        for n in n.body
        if isinstance(n, ast.Assign) and [getattr(t, "id", None) for t in n.targets] == ["arch"]
    }
    return [
        (n.lineno, n.value)
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in named
    ]


def arch_uses(tree, arch_names):
    """(line, name) of every arch name used as one: compared with an arch (`args.arch == "nag"`), listed with another
    (`("gpt", "nag")`), or a hyphenated one anywhere. "gpt" and "nag" alone are also roles, keys and op namespaces."""

    def names_in(node):
        elts = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
        return [e for e in elts if isinstance(e, ast.Constant) and e.value in arch_names]

    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and "arch" in ast.unparse(node):  # `"nag" in row` is a key, not an arch
            for operand in [node.left, *node.comparators]:
                found.update((id(e), e) for e in names_in(operand))
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(names_in(node)) >= 2:
            found.update((id(e), e) for e in names_in(node))
        elif isinstance(node, ast.Constant) and node.value in arch_names and "-" in str(node.value):
            found[id(node)] = node
    return sorted((e.lineno, e.value) for e in found.values())


def literal_problems(root, arch_names):
    """Every file name of FILE_OWNERS spelled outside its owner, and every arch name outside ARCH_NAME_PLACES."""
    problems = []
    for folder in SOURCES:
        for rel, text in py_files(root, folder):
            tree = ast.parse(text)
            for line, value in string_constants(tree):
                if value in FILE_OWNERS and rel != FILE_OWNERS[value]:
                    problems.append(f"{rel}:{line} spells {value!r}: ask {FILE_OWNERS[value]}")
            if not rel.startswith(ARCH_NAME_PLACES):
                constants = set(string_constants(tree))  # a class's own `arch = "..."` is not among them
                problems += [
                    f"{rel}:{line} names the arch {value!r}: ask nag/archs.py"
                    for line, value in arch_uses(tree, arch_names)
                    if (line, value) in constants
                ]
    return problems


def opening_problems(root):
    """Every module whose docstring's first line is missing or longer than MAX_OPENING characters."""
    problems = []
    for folder in SOURCES + ("tests",):
        for rel, text in py_files(root, folder):
            doc = ast.get_docstring(ast.parse(text), clean=True)
            first = doc.strip().splitlines()[0] if doc and doc.strip() else ""
            if not first or len(first) > MAX_OPENING:
                problems.append(
                    f"{rel}:1 opens with {len(first)} characters: one line of at most {MAX_OPENING} says its job"
                )
    return problems


def own_flags(parser, arch_dests):
    return [a for a in parser._actions if a.dest != "help" and a.dest not in arch_dests]


def test_each_file_name_and_arch_name_has_one_owner():
    from nag.archs import ARCHS

    problems = literal_problems(REPO, set(ARCHS))
    assert not problems, "\n" + "\n".join(problems)


def test_every_module_opens_with_one_short_line():
    problems = opening_problems(REPO)
    assert not problems, "\n" + "\n".join(problems)


def test_base_train_has_few_flags_of_its_own_in_groups():
    import argparse
    from nag.archs import add_arch_args
    from nag.train_flags import build_parser

    archs = argparse.ArgumentParser()
    add_arch_args(archs)
    arch_dests = {a.dest for a in archs._actions}
    parser = build_parser()
    own = own_flags(parser, arch_dests)
    assert len(own) <= MAX_OWN_FLAGS, sorted(a.dest for a in own)
    groups = {g.title.split(":")[0]: {a.dest for a in g._group_actions} for g in parser._action_groups}
    assert [
        t
        for t in groups
        if t not in ("positional arguments", "options") and not any(d in arch_dests for d in groups[t])
    ] == [
        "run",
        "model",
        "horizon and batch (of the horizon flags, the first one set wins)",
        "optimizer",
        "evaluation during training",
        "operations",
    ]
    assert all(any(a.dest in g for g in groups.values() if g) for a in own)  # every one of them in a group


def test_the_literal_and_opening_checkers_catch_what_they_should(tmp_path):
    write(
        tmp_path,
        {
            "nanochat/run_dir.py": '"""Run files."""\nCONFIG = "config.json"\n',  # its owner: fine
            "nanochat/tokenizer.py": '"""Tokenizer."""\nP = "tokenizer.pkl"\n',  # its owner: fine
            "nanochat/dataloader.py": '"""Loader."""\nP = "token_bytes.pt"\n',
            "scripts/speedrun.py": '"""Speedrun."""\nimport os\np = os.path.join("r", "eval.json")\n'
            'help = "see config.json"\n',
            "analysis/run.py": '"""' + "x" * 101 + '"""\nmetrics = "metrics.jsonl"\n',
            "nag/archs.py": '"""Archs."""\nARCHS = {"gpt": 1, "nag": 2}\n',  # the registry: fine
            "nag/model.py": 'class NAGGPT:\n    arch = "nag"\n',  # a class naming itself: fine, but no docstring
            "nag/hf/modeling.py": '"""HF."""\nif arch in ("gpt", "nag"): pass\n',  # standalone export: fine
            "scripts/experiments/sweep.py": '"""Sweep."""\nPAIR = ("gpt", "nag")\nnote = "gpt or nag"\n'
            'kw = {"nag": 1}\n'
            'if arch == "nag": pass\nx = "gpt-router"\nrole(args, "gpt")\n'
            'ok = "nag" in row or op.namespace == "nag"\n',
            "tests/test_x.py": '"""' + "y" * 100 + '"""\nA = "gpt"\n',  # tests: names free, opening of 100 fine
        },
    )
    got = literal_problems(tmp_path, {"gpt", "nag", "gpt-router"})
    assert where(got) == sorted(
        [
            "nanochat/dataloader.py:2",
            "scripts/speedrun.py:3",
            "analysis/run.py:2",
            "scripts/experiments/sweep.py:2",
            "scripts/experiments/sweep.py:2",
            "scripts/experiments/sweep.py:5",
            "scripts/experiments/sweep.py:6",
        ]
    ), got
    assert where(opening_problems(tmp_path)) == ["analysis/run.py:1", "nag/model.py:1"]


MAX_LINE = 120  # pyproject.toml's [tool.ruff] line-length
# a docstring's shown command stays one line: tests/test_examples.py runs it as written
COMMAND_STARTS = ("python ", "torchrun ", "bash ", "NANOCHAT_", "EVAL_BUNDLE=", "SEEDS=", "CUDA_", "OMP_NUM_THREADS=")


def long_line_problems(root):
    """Every line over MAX_LINE characters, but a shown command."""
    problems = []
    for folder in SOURCES + ("tests",):
        for rel, text in py_files(root, folder):
            for i, line in enumerate(text.splitlines(), 1):
                if len(line) > MAX_LINE and not line.strip().startswith(COMMAND_STARTS):
                    problems.append(f"{rel}:{i} has {len(line)} characters (at most {MAX_LINE})")
    return problems


def test_lines_are_at_most_120_characters():
    problems = long_line_problems(REPO)
    assert not problems, "\n" + "\n".join(problems)


def test_the_line_checker_catches_what_it_should(tmp_path):
    write(
        tmp_path,
        {
            "nanochat/a.py": "x = 1\n" + "y = '" + "z" * 115 + "'\n",  # 121 characters
            "scripts/b.py": '"""Run it.\n\n    python -m scripts.b '
            + "--flag " * 20
            + '\n"""\n'
            + "# "
            + "×" * 118
            + "\n",
            "tests/test_c.py": "w = '" + "v" * 200 + "'\n",
        },
    )
    assert where(long_line_problems(tmp_path)) == ["nanochat/a.py:2", "tests/test_c.py:1"]
