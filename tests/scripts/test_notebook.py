"""notebooks/quickstart.ipynb runs top to bottom (so it never rots)."""

from __future__ import annotations

import pathlib

import pytest

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")

NOTEBOOK = pathlib.Path(__file__).resolve().parents[2] / "notebooks" / "quickstart.ipynb"


def test_quickstart_notebook_executes(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = "".join(o.get("text", "") for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs)
    assert "Paris" in outputs and "output tok/s" in outputs
    assert (tmp_path / "cost_model.png").stat().st_size > 10_000
    assert "update_lora" in outputs and (tmp_path / "grpo.png").stat().st_size > 10_000  # the GRPO section ran
