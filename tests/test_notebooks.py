"""Every notebook in notebooks/ runs top to bottom in a fresh kernel and draws its figures; the
committed copies carry no outputs."""
import json
import re
import threading
import time

import pytest

import helpers

NOTEBOOKS = helpers.REPO / "notebooks"
TEXT_DIR = helpers.REPO.parent / "shared" / "text" / "shakespeare"
# name → (figures it must draw, what it needs)
EXPECTED = {
    "quickstart": (1, "cifar"),
    "multi_worker": (1, "cifar"),
    "scaling": (3, None),
    "recommender": (1, None),
    "masked_lm": (1, "text"),
}


def execute(name: str, cwd) -> tuple[dict, float]:
  """Runs notebooks/<name>.ipynb with cwd as its working directory; raises on a failing cell."""
  import nbclient  # pylint: disable=g-import-not-at-top
  import nbformat  # pylint: disable=g-import-not-at-top
  notebook = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
  client = nbclient.NotebookClient(notebook, timeout=900, kernel_name="python3",
                                   resources={"metadata": {"path": str(cwd)}})
  start = time.time()
  client.execute(env=helpers.env(TFDP_TEXT_DIR=TEXT_DIR))
  return notebook, time.time() - start


def outputs(notebook) -> list[dict]:
  return [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]


def text_of(notebook) -> str:
  parts = []
  for output in outputs(notebook):
    parts.append(output.get("text", ""))
    parts.append(output.get("data", {}).get("text/plain", ""))
  return "\n".join(parts)


def test_every_notebook_is_tested_and_committed_without_outputs():
  assert sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb")) == sorted(EXPECTED)
  for path in NOTEBOOKS.glob("*.ipynb"):
    cells = json.loads(path.read_text())["cells"]
    code = [cell for cell in cells if cell["cell_type"] == "code"]
    assert code, path.name
    assert all(not cell["outputs"] and cell["execution_count"] is None for cell in code), (
        f"{path.name} has outputs: strip them before committing")


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_notebook_runs_and_draws_its_figures(name, tmp_path):
  figures, needs = EXPECTED[name]
  if needs == "cifar" and not helpers.HAVE_CIFAR:
    pytest.skip(helpers.NO_CIFAR_REASON)
  if needs == "text" and not TEXT_DIR.is_dir():
    pytest.skip(f"Shakespeare's plays not found in {TEXT_DIR}")
  notebook, seconds = execute(name, tmp_path)
  print(f"{name}: {seconds:.0f} s")
  assert not [o for o in outputs(notebook) if o.output_type == "error"]
  pngs = [o for o in outputs(notebook) if "image/png" in o.get("data", {})]
  assert len(pngs) == figures, f"{name} drew {len(pngs)} figures, expected {figures}"
  text = text_of(notebook)
  if name == "quickstart":
    assert "on 1000 images, 2 replicas" in text, text[-2000:]
  if name == "multi_worker":  # both workers answered, from one 2-worker strategy
    # CollectiveAllReduceStrategy: MultiWorkerMirroredStrategy's class name in TF 2.21
    assert "[w1] " in text and text.count("CollectiveAllReduceStrategy") == 2, text[-3000:]
  if name == "recommender":  # what the notebook says: near the planted noise of 0.3
    assert float(re.search(r"test RMSE (\d\.\d+)", text).group(1)) < 0.4, text[-2000:]
  if name in ("quickstart", "multi_worker", "recommender", "masked_lm"):
    assert list(tmp_path.glob("runs/*/metrics.png")), "tfdp wrote no metrics.png"


def test_launch_notebook_names_the_failing_worker_and_its_error():
  import tfdp  # pylint: disable=g-import-not-at-top

  def train_fn(bad_worker):
    import os  # pylint: disable=g-import-not-at-top
    if os.environ["TFDP_WORKER_INDEX"] == str(bad_worker):
      raise ValueError("no such column: 'labels'")
    return "ok"

  with pytest.raises(tfdp.TfdpError, match=r"worker 1 exited with code 1.*no such column"):
    tfdp.launch_notebook(train_fn, num_workers=2, args=(1,), env=helpers.env())
  with pytest.raises(tfdp.TfdpError, match="cannot be sent to the workers"):
    tfdp.launch_notebook(train_fn, args=(threading.Lock(),))  # a lock cannot be pickled
