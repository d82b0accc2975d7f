"""requirements.lock: what runs/setup_env.sh installs, exactly.

docs/runs.md, "What reproducible means", explains why."""

import hashlib
import os
import re
import sys
import tomllib
from importlib import metadata

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCK = os.path.join(REPO, "requirements.lock")


def lock_pins(text):
    """{package: version} of the lock's lines whose marker holds on this Python and platform."""
    pins = {}
    for line in text.splitlines():
        m = re.match(r"([A-Za-z0-9_.-]+)==([^ ;]+)\s*(?:;\s*(.+))?$", line)
        if m and (m.group(3) is None or Marker(m.group(3)).evaluate()):
            pins[m.group(1).lower().replace("_", "-")] = m.group(2)
    return pins


def direct_dependencies():
    """The project's own requirements (and its test tools') that apply here, by name."""
    project = tomllib.load(open(os.path.join(REPO, "pyproject.toml"), "rb"))["project"]
    reqs = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]]
    return [r.name.lower() for r in reqs if r.marker is None or r.marker.evaluate()]


def test_the_lock_pins_every_direct_dependency_once_per_python():
    pins = lock_pins(open(LOCK).read())
    for name in direct_dependencies():
        assert name in pins, f"{name} is not in requirements.lock: run `bash runs/lock.sh`"
    assert pins["torch"] == re.search(r"^torch==(\S+)", open(LOCK).read(), re.M).group(1)  # one torch for every Python
    assert lock_pins("numpy==1.0 ; python_full_version < '3.0'\nnumpy==2.0\n") == {"numpy": "2.0"}  # markers are read


def test_a_venv_made_from_the_lock_has_exactly_its_versions():
    """Where setup_env.sh made this venv from the current lock (its stamp holds the lock's sha256), every direct
    dependency is at the lock's version (torch's local build tag, +cpu or +cu130, aside)."""
    stamp = os.path.join(sys.prefix, ".nanochat-lock")
    lock = open(LOCK, "rb").read()
    if not os.path.exists(stamp) or open(stamp).read().strip() != hashlib.sha256(lock).hexdigest():
        pytest.skip("this venv was not made by runs/setup_env.sh from the current requirements.lock")
    pins = lock_pins(lock.decode())
    installed = {name: metadata.version(name).split("+")[0] for name in direct_dependencies()}
    assert installed == {name: pins[name] for name in installed}
