"""The run folder of `dflash-train run`: what may be trained into (check_run_folder) and the
metrics log it keeps (metrics.jsonl, TensorBoard optionally)."""

from __future__ import annotations

import json
from pathlib import Path

from dflash_common.errors import ConfigError
from dflash_common.files import LOCK_FILE, append_line, disk_full_at, foreign_entries, holds, refuse_links
from dflash_common.settings_files import load_settings_file


class MetricsLog:
    """metrics.jsonl in the run folder (appended, so a resumed run continues it), TensorBoard optionally."""

    def __init__(self, out: Path, tensorboard: bool):
        self.out, self.path = out, out / "metrics.jsonl"
        self.writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ConfigError("--tensorboard needs the tensorboard package; pip install tensorboard") from None
            refuse_links(out / "tensorboard", out)  # its event files are written by TensorBoard, not through us
            self.writer = SummaryWriter(str(out / "tensorboard"))

    def write(self, record: dict) -> None:
        with disk_full_at(self.path):  # the run's own line says what is kept (trainer.run_disk_full)
            append_line(self.path, json.dumps(record), root=self.out)
        if self.writer is not None and "step" in record:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self.writer.add_scalar(f"{record.get('kind', 'train')}/{key}", value, record["step"])


# What a run folder may hold before its config.json exists: a sweep writes the run's log first,
# and the run's lock (one_writer) is taken before config.json is written.
_BEFORE_CONFIG = {"train.log", LOCK_FILE}


# What a run writes or deletes in its folder; none of them may be a symlink (see refuse_links).
RUN_ENTRIES = ("config.json", "metrics.jsonl", "checkpoints", "drafter", "tensorboard", LOCK_FILE)


def check_run_folder(out: Path) -> None:
    """Refuse an --out that is not ours to write into: a file, or a non-empty folder that is not a
    dflash-train run (a run writes config.json first), since training replaces config.json and
    drafter/ there; and a run folder where one of the entries a run writes is a symlink, before
    any work (every write checks again)."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a folder; choose a new or empty folder for the run")
    if not out.is_dir():
        return
    for name in RUN_ENTRIES:
        refuse_links(out / name, out)
    if (out / "checkpoints").is_dir():  # step folders are pruned, and leftovers deleted
        for entry in (out / "checkpoints").iterdir():
            refuse_links(entry)
    config = out / "config.json"
    if config.is_file():
        try:  # bounded: a config.json of gigabytes (or a link to /dev/zero) is not a run's
            values = load_settings_file(str(config))
        except (OSError, ConfigError):
            values = None
        if isinstance(values, dict) and {"cache", "model", "loss", "optim"} <= set(values):
            return
        raise ConfigError(f"--out {out} holds a config.json that is not a dflash-train run's; choose a new or empty "
                          "folder (training would overwrite it and replace drafter/)")
    foreign = foreign_entries(out, lambda entry: entry.name in _BEFORE_CONFIG)
    if foreign:
        raise ConfigError(f"--out {out} is a non-empty folder that is not a dflash-train run (it holds {holds(foreign)}); "
                          "choose a new or empty folder")
