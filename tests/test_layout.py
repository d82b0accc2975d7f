"""The layout's rules (docs/design.md §1), read from the source: commands on top, no command importing another,
the baseline free of NAG. Each checker takes a root folder, so a fake tree shows that it catches what it should."""

import ast
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# a command's public entries: its flags into a namespace, its work from one, its command line
ENTRIES = {"main", "parse_args", "build_parser", "train", "evaluate"}
# the drivers, and the benchmarks (they shape their models with base_train's flags), may use those entries
USERS_OF_ENTRIES = ("scripts/speedrun.py", "scripts/experiments/", "scripts/bench/")
# libraries under scripts/: the drivers' shared set-up; bench.nag reuses bench.train's timing of a step
LIBRARIES = {"scripts.experiments": ("scripts/experiments/",),
             "scripts.bench.train": ("scripts/bench/nag.py",)}


def py_files(root, folder):
    for dirpath, _, names in os.walk(os.path.join(root, folder)):
        for name in sorted(names):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                yield os.path.relpath(path, root).replace(os.sep, "/"), open(path, encoding="utf-8").read()


def module_of(rel):
    return rel[:-3].replace("/", ".").removesuffix(".__init__")


def imported(tree, root):
    """(line, module, names used from it) of every import of a scripts module. A module imported whole (`from scripts
    import base_train`, `import scripts.x`) is followed to the attributes read from it."""
    is_module = lambda m: os.path.exists(os.path.join(root, *m.split(".")) + ".py")
    aliases, out = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "scripts":
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if is_module(full):  # from scripts(.bench) import X: a module, used through its alias
                    aliases[a.asname or a.name] = (node.lineno, full)
                else:
                    out.append((node.lineno, node.module, {a.name}))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "scripts":
                    aliases[a.asname or a.name] = (node.lineno, a.name)
    used = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            used.setdefault(node.value.id, set()).add(node.attr)
    out += [(line, module, used.get(alias, set())) for alias, (line, module) in aliases.items()]
    return sorted(out, key=lambda x: x[0])


def command_import_problems(root):
    """Every import in scripts/ of another command beyond the rules, and every import of scripts/ from the layers below."""
    problems = []
    for rel, text in py_files(root, "scripts"):
        me = module_of(rel)
        for line, module, names in imported(ast.parse(text), root):
            if module == me:
                continue
            if module in LIBRARIES and rel.startswith(LIBRARIES[module]):
                continue
            if rel.startswith(USERS_OF_ENTRIES) and names <= ENTRIES:
                continue
            problems.append(f"{rel}:{line} imports {module} ({', '.join(sorted(names)) or 'the module'}): a command imports another")
    for layer in ("nanochat", "nag", "analysis"):
        for rel, text in py_files(root, layer):
            for node in ast.walk(ast.parse(text)):
                mods = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
                       [a.name for a in node.names] if isinstance(node, ast.Import) else []
                for m in mods:
                    if m.split(".")[0] == "scripts":
                        problems.append(f"{rel}:{node.lineno} imports {m}: {layer}/ stands below the commands")
    return problems


# the project's own name (a tracker's project) is not the architecture's
NAG_WORD = re.compile(r"(?i:(?<![\w-])nag(?!-chat)(?![a-z]))|\bNAG[A-Z]|--nag-")


def baseline_problems(root):
    """Every line under nanochat/ that names NAG, and every import there of nag/ or analysis/."""
    problems = []
    for rel, text in py_files(root, "nanochat"):
        for i, line in enumerate(text.splitlines(), 1):
            if NAG_WORD.search(line):
                problems.append(f"{rel}:{i} names NAG: {line.strip()[:100]}")
        for node in ast.walk(ast.parse(text)):
            mods = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
                   [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for m in mods:
                if m.split(".")[0] in ("nag", "analysis", "scripts"):
                    problems.append(f"{rel}:{node.lineno} imports {m}: the baseline imports nothing above it")
    return problems


def test_no_command_imports_another():
    assert command_import_problems(REPO) == []


def test_the_baseline_names_no_nag():
    assert baseline_problems(REPO) == []


def write(root, rel, text):
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_checkers_catch_what_they_should(tmp_path):
    write(tmp_path, "scripts/base_train.py", "def train(args): pass\ndef make_plan(): pass\n")
    write(tmp_path, "scripts/compare.py", "from scripts.base_train import make_plan\n")  # a command's internals
    write(tmp_path, "scripts/sample.py", "from scripts import base_train\nbase_train.train(None)\n")  # not a driver or benchmark
    write(tmp_path, "scripts/speedrun.py", "from scripts import base_train\nbase_train.parse_args([])\n")  # a driver's entry: fine
    write(tmp_path, "scripts/experiments/sweep.py", "from scripts import base_train\nbase_train.make_plan()\n"
                                                     "from scripts.experiments import prepare\n")
    write(tmp_path, "nag/archs.py", "from scripts.base_train import train\n")
    write(tmp_path, "nanochat/gpt.py", "import torch\n# the NAG branch lives elsewhere\nPROJECT = 'nag-chat'\n")
    write(tmp_path, "nanochat/plan.py", "from nag.archs import ARCHS\nx = 1  # --nag-gate-lr\n")
    write(tmp_path, "nanochat/ok.py", "# snag, nagging and nag-chat are words, not the arch\n")
    write(tmp_path, "nanochat/conf.py", "cfg = NAGConfig()\n")
    got = command_import_problems(tmp_path)
    assert [p.split(" ")[0] for p in got] == ["scripts/compare.py:1", "scripts/sample.py:1", "scripts/experiments/sweep.py:1",
                                             "nag/archs.py:1"], got
    got = baseline_problems(tmp_path)
    assert [p.split(" ")[0] for p in got] == ["nanochat/conf.py:1", "nanochat/gpt.py:2", "nanochat/plan.py:1", "nanochat/plan.py:2",
                                             "nanochat/plan.py:1"], got
