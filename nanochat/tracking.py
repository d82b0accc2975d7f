"""
Optional experiment tracking: metrics rows to TensorBoard, Weights & Biases and/or Trackio.

Every metrics.jsonl row also goes to TensorBoard, Weights & Biases and/or Trackio
(`base_train --log-to tensorboard,wandb,trackio`, any subset; none by default). Each is in the [track] extra
(pip install -e '.[track]'); training never imports them unless asked (docs/interop.md §5).

    trackers = open_trackers(parse_log_to("tensorboard,wandb"), run_name, run_dir, config, project)  # rank 0 only
    trackers.log(row)  # a metrics.jsonl row: step from row["step"], nested dicts as "time/data" keys
    trackers.close()

- tensorboard: event files in <run dir>/tensorboard/ (`tensorboard --logdir <run dir>`), plain scalar summaries (what
  TensorBoard's charts and EventAccumulator.Scalars() read; float32, 7 digits: metrics.jsonl keeps every digit), the
  config as text;
- wandb: project $WANDB_PROJECT (default: the caller's project name), the run's name, every file under <run dir>/wandb/
  (its service's debug logs too, which would go to ~/.cache/wandb/logs: $WANDB_CACHE_DIR, yours wins). Offline unless an
  API key is set (WANDB_API_KEY, or `wandb login`'s netrc entry) or WANDB_MODE says otherwise: it never asks for a key.
  `wandb sync <run dir>/wandb/offline-run-*` uploads an offline run later;
- trackio: the caller's project, the run's name, a local database in $TRACKIO_DIR (default ~/.cache/huggingface/trackio;
  `trackio show --project <project>`).
"""

import os
import json
import atexit
import netrc
from urllib.parse import urlparse

from nanochat.common import UserError

KINDS = ("tensorboard", "wandb", "trackio")
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}
EXTRA = "pip install -e '.[track]'"


def parse_log_to(text):
    """--log-to's value ("tensorboard,wandb", "" for none) as a list of kinds, each package imported now: a typo or a
    missing extra fails before training starts, in one line."""
    kinds = [k.strip() for k in (text or "").split(",") if k.strip()]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise UserError(
            f"--log-to takes a comma-separated subset of {', '.join(KINDS)}, got {', '.join(map(repr, unknown))}"
        )
    for kind in kinds:
        try:
            __import__(PACKAGES[kind])
        except ImportError:
            raise UserError(f"--log-to {kind} needs the {PACKAGES[kind]} package: {EXTRA}") from None
    return list(dict.fromkeys(kinds))


def flatten(row, prefix=""):
    """A metrics row's numbers as {"time/data": 0.01, "gate/branches/0.attn/u_mean": 0.5, ...}: nested dicts joined with
    "/", list items by index (or by their "name": the gate's branches), booleans as 0/1; None and text left out."""
    out = {}
    for key, value in row.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "/"))
        elif isinstance(value, (list, tuple)):
            named = all(isinstance(v, dict) and "name" in v for v in value)
            items = {
                (v["name"] if named else str(i)): ({k: x for k, x in v.items() if k != "name"} if named else v)
                for i, v in enumerate(value)
            }
            out.update(flatten(items, name + "/"))
        elif isinstance(value, bool):
            out[name] = int(value)
        elif isinstance(value, (int, float)):
            out[name] = value
    return out


def scalars(row):
    """(step, {name: number}) of a metrics row; the step itself is the x axis, not a series."""
    return row["step"], flatten({k: v for k, v in row.items() if k != "step"})


# ----- the backends: open(run_name, run_dir, config), then log(step, values) and close() -----


class TensorBoard:
    def __init__(self, project, run_name, run_dir, config):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=os.path.join(run_dir, "tensorboard"))
        # TensorBoard's text is markdown: indented four spaces, the JSON shows as code
        text = "\n".join(
            "    " + line for line in json.dumps(config, indent=2, sort_keys=True, default=str).splitlines()
        )
        self.writer.add_text("config", f"run {run_name}\n\n{text}", 0)

    def log(self, step, values):
        for name, v in values.items():
            self.writer.add_scalar(name, v, step)

    def close(self):
        self.writer.close()


def wandb_has_key():
    """An API key in the environment or in wandb login's netrc entry for its host."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


class WandB:
    def __init__(self, project, run_name, run_dir, config):
        import wandb

        # offline never prompts for a key
        mode = os.environ.get("WANDB_MODE") or ("online" if wandb_has_key() else "offline")
        # its service writes debug logs to $WANDB_CACHE_DIR/wandb/logs (default ~/.cache):
        # set for the service it starts now
        ours = "WANDB_CACHE_DIR" not in os.environ
        if ours:
            os.environ["WANDB_CACHE_DIR"] = run_dir
        try:
            self.run = wandb.init(
                project=os.environ.get("WANDB_PROJECT", project), name=run_name, dir=run_dir, config=config, mode=mode
            )
        finally:
            if ours:
                os.environ.pop("WANDB_CACHE_DIR", None)

    def log(self, step, values):
        self.run.log(values, step=step)

    def close(self):
        self.run.finish()


class Trackio:
    def __init__(self, project, run_name, run_dir, config):
        import trackio

        self.run = trackio.init(project=project, name=run_name, config=json.loads(json.dumps(config, default=str)))

    def log(self, step, values):
        self.run.log(values, step=step)

    def close(self):
        self.run.finish()


BACKENDS = {"tensorboard": TensorBoard, "wandb": WandB, "trackio": Trackio}


class Trackers:
    """The open backends, fed the same rows; with none, log and close do nothing."""

    def __init__(self, backends=()):
        self.backends = list(backends)

    def log(self, row):
        if not self.backends:
            return
        step, values = scalars(row)
        for b in self.backends:
            b.log(step, values)

    def close(self):
        backends, self.backends = self.backends, []  # once: close() is also registered to run at exit
        for b in backends:
            b.close()


def open_trackers(kinds, run_name, run_dir, config, project):
    """Trackers for the kinds parse_log_to returned, logging under the project and the run's name (rank 0 only: one run
    per run). Closed at exit too, so that a run that stops on an error still flushes what it logged."""
    trackers = Trackers()
    for kind in kinds:
        try:
            trackers.backends.append(BACKENDS[kind](project, run_name, run_dir, config))
        except Exception as e:  # e.g. wandb online without a route to its server: one line, not a traceback
            trackers.close()
            raise UserError(
                f"--log-to {kind}: cannot start the tracker ({type(e).__name__}: {' '.join(str(e).split())[:300]})"
            ) from None
    if trackers.backends:
        atexit.register(trackers.close)
    return trackers
