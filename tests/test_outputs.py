"""model_dir bookkeeping: who writes, what a re-run keeps, what a killed worker leaves."""
import os
from pathlib import Path

import pandas as pd
import pytest

from tfdp import plots
from tfdp.core import outputs
from tfdp.core import resume
from tfdp.errors import OutputError


def test_non_chief_writes_to_its_own_temp_dir_and_stale_ones_are_removed(tmp_path, monkeypatch):
  monkeypatch.setenv("TMPDIR", str(tmp_path))
  monkeypatch.setattr(outputs.tempfile, "tempdir", None)
  stale = tmp_path / "tfdp-worker1-pid999999999-x"  # a SIGKILLed worker's leftover
  stale.mkdir()
  live = tmp_path / f"tfdp-worker2-pid{os.getpid()}-y"  # a running worker's: kept
  live.mkdir()
  plan = outputs.write_plan(str(tmp_path / "model"), is_chief=False, rank=1)
  assert not stale.exists() and live.exists()
  assert plan.checkpoint_dir.startswith(str(tmp_path / "tfdp-worker1-"))
  assert plan.restore_dir == str(tmp_path / "model" / "checkpoints")
  outputs.write_config(plan, "a: 1\n", resuming=False)
  outputs.append_metrics(plan, {"epoch": 1})
  assert not (tmp_path / "model").exists()  # a non-chief writes nothing into model_dir
  plan.cleanup()
  assert not os.path.exists(plan.write_dir)


def test_chief_metrics_replace_a_rerun_epoch_and_config_keeps_the_earlier_one(tmp_path):
  plan = outputs.write_plan(str(tmp_path), is_chief=True, rank=0)
  outputs.append_metrics(plan, {"epoch": 1, "step": 10, "loss": 2.0})
  outputs.append_metrics(plan, {"epoch": 2, "step": 20, "loss": 1.5})
  outputs.append_metrics(plan, {"epoch": 2, "step": 20, "loss": 1.4})  # epoch 2 again, resumed
  frame = pd.read_csv(tmp_path / "metrics.csv")
  assert frame["epoch"].tolist() == [1, 2] and frame["loss"].tolist() == [2.0, 1.4]
  outputs.write_config(plan, "trainer: {epochs: 1}\n", resuming=False)
  outputs.write_config(plan, "trainer: {epochs: 1}\n", resuming=False)  # same config: nothing kept aside
  assert not list(tmp_path.glob("config.*.yaml"))
  outputs.write_config(plan, "trainer: {epochs: 2}\n", resuming=False)
  assert (tmp_path / "config.yaml").read_text() == "trainer: {epochs: 2}\n"
  assert [p.read_text() for p in tmp_path.glob("config.*.yaml")] == ["trainer: {epochs: 1}\n"]


def test_metrics_columns_are_in_one_order_whichever_epochs_were_evaluated(tmp_path):
  """A probe: wall_time came before or after the eval_* columns, as epoch 1 was evaluated or
  not, which broke scripts reading columns by position. Seen failing on the old outputs.py."""
  orders = []
  for first_evaluated in (True, False):
    (tmp_path / str(first_evaluated)).mkdir()
    plan = outputs.write_plan(str(tmp_path / str(first_evaluated)), is_chief=True, rank=0)
    for epoch in (1, 2):
      evaluated = {"eval_loss": 1.0} if first_evaluated or epoch == 2 else {}
      outputs.append_metrics(plan, {"epoch": epoch, "train_loss": 2.0, **evaluated,
                                    "wall_time": 5.0})
    orders.append(list(pd.read_csv(tmp_path / str(first_evaluated) / "metrics.csv").columns))
  assert orders[0] == orders[1] == ["epoch", "train_loss", "eval_loss", "wall_time"], orders


def test_configs_kept_within_one_second_each_keep_their_own_file(tmp_path, monkeypatch):
  """A review: config.yaml was moved to config.<second>.yaml, so a second change within that
  second overwrote the first one kept (and config.yaml was missing until the new one was
  written). Seen failing: the epochs 1 config was lost."""
  import time  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(time, "strftime", lambda fmt, *args: "20261206-101010")
  plan = outputs.write_plan(str(tmp_path), is_chief=True, rank=0)
  for epochs in (1, 2, 3):
    outputs.write_config(plan, f"trainer: {{epochs: {epochs}}}\n", resuming=False)
  assert (tmp_path / "config.yaml").read_text() == "trainer: {epochs: 3}\n"
  assert sorted(p.read_text() for p in tmp_path.glob("config.*.yaml")) == [
      "trainer: {epochs: 1}\n", "trainer: {epochs: 2}\n"]


def test_unreadable_metrics_csv_is_set_aside_and_a_fresh_one_started(tmp_path):
  plan = outputs.write_plan(str(tmp_path), is_chief=True, rank=0)
  for bad in (b"", b"\x00\xff garbage\n\"unclosed", b"step,loss\n10,2.0\n"):  # last: no epoch column
    (tmp_path / "metrics.csv").write_bytes(bad)
    outputs.append_metrics(plan, {"epoch": 1, "step": 10, "loss": 2.0})
    assert pd.read_csv(tmp_path / "metrics.csv")["epoch"].tolist() == [1]
  kept = sorted(p.read_bytes() for p in tmp_path.glob("metrics.csv.bad-*"))
  assert len(kept) == 3 and b"" in kept  # three set aside, none overwritten


def test_temp_files_are_created_exclusively_and_never_follow_a_planted_link(tmp_path):
  victim = tmp_path / "victim"
  victim.write_text("keep\n")
  model_dir = tmp_path / "run"
  model_dir.mkdir()
  for name in ("config.yaml", "metrics.csv"):  # the old predictable temp name, planted
    (model_dir / f"{name}.tmp-{os.getpid()}").symlink_to(victim)
  plan = outputs.write_plan(str(model_dir), is_chief=True, rank=0)
  outputs.write_config(plan, "a: 1\n", resuming=False)
  outputs.append_metrics(plan, {"epoch": 1})
  assert victim.read_text() == "keep\n"
  assert (model_dir / "config.yaml").read_text() == "a: 1\n" and not os.path.islink(model_dir / "config.yaml")
  assert not [p for p in model_dir.iterdir() if ".tmp" in p.name and not p.is_symlink()]


def test_export_writes_a_loadable_model_through_an_exclusive_temp_file(tmp_path):
  import keras  # pylint: disable=g-import-not-at-top
  plan = outputs.write_plan(str(tmp_path), is_chief=True, rank=0)
  model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
  path = outputs.export_model(plan, model)
  assert keras.saving.load_model(path).count_params() == 8
  mask = os.umask(0)
  os.umask(mask)
  assert os.stat(path).st_mode & 0o777 == 0o666 & ~mask  # not mkstemp's 0600
  assert os.listdir(tmp_path) == ["model.keras"]


@pytest.mark.parametrize("mode,refused", [(0o777, True), (0o1777, False), (0o755, False)])
def test_a_world_writable_model_dir_is_refused_unless_sticky(tmp_path, mode, refused):
  model_dir = tmp_path / "run"
  model_dir.mkdir()
  model_dir.chmod(mode)
  if not refused:
    assert outputs.prepare_model_dir(str(model_dir)) == str(model_dir)
    return
  with pytest.raises(OutputError) as error:
    outputs.prepare_model_dir(str(model_dir))
  assert str(model_dir) in str(error.value) and "chmod o-w" in str(error.value)
  assert os.listdir(model_dir) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
def test_a_model_dir_owned_by_another_user_is_refused(tmp_path):
  model_dir = tmp_path / "run"
  model_dir.mkdir()
  os.chown(model_dir, 12345, -1)
  with pytest.raises(OutputError) as error:
    outputs.prepare_model_dir(str(model_dir))
  assert str(model_dir) in str(error.value) and "your own" in str(error.value)


def test_metrics_png_is_redrawn_after_the_last_epoch_and_otherwise_every_half_minute(tmp_path):
  """A draw costs ~0.5 s of the training thread; 1-second epochs redrew it every epoch."""
  short, long = tmp_path / "short", tmp_path / "long"
  short.mkdir()
  long.mkdir()
  plan = outputs.write_plan(str(short), is_chief=True, rank=0)
  for epoch in (1, 2):
    outputs.append_metrics(plan, {"epoch": epoch, "step": epoch, "loss": 1.0,
                                  "epoch_seconds": 1.0}, last=False)
  assert (short / "metrics.csv").exists() and not (short / "metrics.png").exists()
  outputs.append_metrics(plan, {"epoch": 3, "step": 3, "loss": 0.5, "epoch_seconds": 1.0})
  assert (short / "metrics.png").exists()  # the last epoch's, always
  plan = outputs.write_plan(str(long), is_chief=True, rank=0)
  outputs.append_metrics(plan, {"epoch": 1, "step": 1, "loss": 1.0,
                                "epoch_seconds": plots.PNG_MIN_SECONDS}, last=False)
  assert (long / "metrics.png").exists()  # an epoch that took half a minute is drawn at once


def test_start_over_moves_the_run_and_copies_the_tasks_files(tmp_path):
  """A task's artifacts stay in place as copies: the config may read one as an input
  (task.text.vocab_path=<model_dir>/vocabulary.txt); moved, the new run could not start."""
  (tmp_path / "checkpoints").mkdir()
  (tmp_path / "checkpoints" / "checkpoint").write_text("state\n")
  for name, text in (("config.yaml", "task: {}\n"), ("vocabulary.txt", "[PAD]\n")):
    (tmp_path / name).write_text(text)
  attic = resume.move_run_aside(str(tmp_path), ["vocabulary.txt"])
  assert sorted(p.name for p in (tmp_path).iterdir()) == sorted(
      [os.path.basename(attic), "vocabulary.txt"])
  assert sorted(p.name for p in Path(attic).iterdir()) == ["checkpoints", "config.yaml",
                                                           "vocabulary.txt"]
  assert (Path(attic) / "vocabulary.txt").read_text() == "[PAD]\n"


def test_runs_set_aside_within_one_second_each_get_their_own_folder(tmp_path, monkeypatch):
  """tfdp.fit in a loop (model_dir=None) sets a run aside per call: two in one second moved
  into one previous-<time>/, and the second failed half-way (OSError: Directory not empty)."""
  monkeypatch.setattr(resume.time, "strftime", lambda *args: "20261206-011046")
  attics = []
  for run in range(3):
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "events").write_text(f"run {run}")
    (tmp_path / "config.yaml").write_text(f"run {run}\n")
    attics.append(resume.move_run_aside(str(tmp_path)))
  assert [os.path.basename(a) for a in attics] == [
      "previous-20261206-011046", "previous-20261206-011046-2", "previous-20261206-011046-3"]
  for run, attic in enumerate(attics):
    assert (Path(attic) / "train" / "events").read_text() == f"run {run}"
    assert (Path(attic) / "config.yaml").read_text() == f"run {run}\n"
  assert sorted(p.name for p in tmp_path.iterdir()) == sorted(os.path.basename(a) for a in attics)


def test_a_lost_newest_checkpoint_names_the_newest_whole_one_by_step_not_by_spelling(tmp_path):
  """ckpt-100 is newer than ckpt-34 (the old message named the last by spelling, ckpt-34); a
  checkpoint whose data shard is missing is not one to resume from."""
  directory = tmp_path / "checkpoints"
  directory.mkdir()
  for name in ("ckpt-34", "ckpt-100", "ckpt-200"):
    (directory / f"{name}.index").write_text("x")
  for name in ("ckpt-34", "ckpt-100"):
    (directory / f"{name}.data-00000-of-00001").write_text("x")
  (directory / "ckpt-200.data-00000-of-00002").write_text("x")  # its second shard is lost
  with pytest.raises(OutputError) as raised:
    outputs.latest_checkpoint(str(tmp_path))
  assert "holds checkpoints (ckpt-200.index) but no 'checkpoint' state file" in str(raised.value)
  assert str(raised.value).endswith(
      f"""to resume from ckpt-100, the newest checkpoint whose files are all there, run: echo """
      f"""'model_checkpoint_path: "ckpt-100"' > {directory / 'checkpoint'} (older checkpoints """
      "stay); or pass --start_over to move the earlier run aside (nothing is deleted) and train "
      "from step 0.")
  (directory / "checkpoint").write_text('model_checkpoint_path: "ckpt-200"\n')
  with pytest.raises(OutputError, match=r"names 'ckpt-200' but '.*ckpt-200.data-\*' is missing; "
                     r"to resume from ckpt-100"):
    outputs.latest_checkpoint(str(tmp_path))
  (directory / "checkpoint").write_text('model_checkpoint_path: "ckpt-100"\n')
  assert outputs.latest_checkpoint(str(tmp_path)) == str(directory / "ckpt-100")


def test_a_warm_start_takes_the_checkpoint_the_init_runs_state_names_not_the_highest(tmp_path):
  """A run pointed back at ckpt-100 (its ckpt-200 damaged) warm-starts others from ckpt-100, as
  it would resume; copied checkpoints without a state file give the newest; a state naming a
  lost checkpoint is one task.init_checkpoint line, with no --start_over advice for this run."""
  from tfdp.core import warm_start  # pylint: disable=g-import-not-at-top
  from tfdp.errors import ConfigError  # pylint: disable=g-import-not-at-top
  directory = tmp_path / "run" / "checkpoints"
  directory.mkdir(parents=True)
  for name in ("ckpt-100", "ckpt-200"):
    (directory / f"{name}.index").write_text("x")
    (directory / f"{name}.data-00000-of-00001").write_text("x")
  assert warm_start.find_init_checkpoint(str(tmp_path / "run")) == str(directory / "ckpt-200")
  (directory / "checkpoint").write_text('model_checkpoint_path: "ckpt-100"\n')
  for given in (tmp_path / "run", directory):
    assert warm_start.find_init_checkpoint(str(given)) == str(directory / "ckpt-100")
  (directory / "checkpoint").write_text('model_checkpoint_path: "ckpt-300"\n')
  with pytest.raises(ConfigError) as raised:
    warm_start.find_init_checkpoint(str(tmp_path / "run"))
  assert str(raised.value) == (
      f"task.init_checkpoint '{tmp_path / 'run'}': checkpoint state '{directory / 'checkpoint'}' "
      f"names 'ckpt-300' but '{directory / 'ckpt-300.index'}' is missing; point it at a "
      "checkpoint prefix (ckpt-N) whose files are all there.")


def test_a_killed_writers_temp_file_is_removed_at_the_next_start(tmp_path):
  """SIGKILL mid-write left metrics.csv.tmp-<pid>-<random> in model_dir for good (a probe);
  the next start removes a dead writer's temp, and keeps a live one's."""
  import subprocess  # pylint: disable=g-import-not-at-top
  dead = subprocess.Popen(["true"])
  dead.wait()
  (tmp_path / f"metrics.csv.tmp-{dead.pid}-bpp9e2m3").write_text("half a row")
  (tmp_path / f".tmp-{dead.pid}-metrics.png").write_text("half a plot")
  (tmp_path / f"config.yaml.tmp-{os.getppid()}-x1y2z3ab").write_text("another writer's")
  (tmp_path / "notes.tmp-keep").write_text("mine")
  (tmp_path / "draft.tmp-2024-notes").write_text("mine too")  # no pid and 8 random characters
  outputs.create_model_dir(str(tmp_path))
  try:
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != ".lock") == [
        f"config.yaml.tmp-{os.getppid()}-x1y2z3ab", "draft.tmp-2024-notes", "notes.tmp-keep"]
  finally:
    from tfdp.core import locks  # pylint: disable=g-import-not-at-top
    locks.release_model_dir(str(tmp_path))


@pytest.mark.parametrize("step, total, last_row_epoch, last_row_step, written", [
    (40, 40, 4, 32, True),  # a finished run killed before its last row: written on the next start
    (16, 32, 1, 8, True),  # an epoch's checkpoint whose row was lost
    (20, 32, 2, 16, False),  # a stop inside an epoch: its row comes when the epoch ends
    (47, 32, 5, 40, False),  # a shortened run: its checkpoint is past the new end (a probe)
    (30, 30, 3, 24, True),  # max_steps ending inside an epoch: the run's last row
    # A run of 9-step epochs (file shards on 2 workers) finished by max_steps at 18, re-run on
    # one process (8-step epochs): its row for step 18 is there; an "epoch 3" row at step 18 was
    # written (a review; seen failing on the old controller.py).
    (18, 18, 2, 18, False),
])
def test_a_lost_metrics_row_is_written_only_for_an_epoch_or_a_run_that_ended(
    monkeypatch, step, total, last_row_epoch, last_row_step, written):
  """A probe stopped a run mid-epoch 6 (checkpoint at step 47 of 8-step epochs) and re-ran it
  with epochs=4: an 'epoch 6' row at step 47 was written for an epoch never completed. Seen
  failing on the old controller.py: (47, 32) written."""
  import types  # pylint: disable=g-import-not-at-top
  from tfdp.core import controller as controller_lib  # pylint: disable=g-import-not-at-top
  appended = []
  monkeypatch.setattr(outputs, "last_metrics_row", lambda plan: {"epoch": last_row_epoch,
                                                                 "step": last_row_step})
  monkeypatch.setattr(outputs, "append_metrics", lambda plan, row, last: appended.append(row))
  monkeypatch.setattr(controller_lib, "memory_mb", lambda: {})
  controller = controller_lib.Controller.__new__(controller_lib.Controller)
  controller.trainer = types.SimpleNamespace(
      steps_per_epoch=8, total_steps=total, schedule=lambda s: 0.1,
      write_plan=types.SimpleNamespace(is_chief=False))
  controller.eval_dataset = None
  controller._evaluate_if_due = lambda epoch, step, row: None  # pylint: disable=protected-access
  controller._write_a_lost_row(step)  # pylint: disable=protected-access
  assert bool(appended) == written, appended


def test_a_metrics_rows_peak_rss_is_never_below_its_rss(monkeypatch):
  """In a clean-clone run (AVX2 imitated) a row had peak_rss_mb 467.059 under rss_mb 467.137:
  the kernel's ru_maxrss lagged the rss read just before it. Seen failing on the old
  controller.py: 1.0 under 2.0."""
  import resource  # pylint: disable=g-import-not-at-top
  import types  # pylint: disable=g-import-not-at-top
  import psutil  # pylint: disable=g-import-not-at-top
  from tfdp.core import controller as controller_lib  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(psutil.Process, "memory_info", lambda self: types.SimpleNamespace(rss=2**21))
  monkeypatch.setattr(resource, "getrusage", lambda who: types.SimpleNamespace(ru_maxrss=1024))
  assert controller_lib.memory_mb() == {"rss_mb": 2.0, "peak_rss_mb": 2.0}
  monkeypatch.setattr(resource, "getrusage", lambda who: types.SimpleNamespace(ru_maxrss=3072))
  assert controller_lib.memory_mb() == {"rss_mb": 2.0, "peak_rss_mb": 3.0}
