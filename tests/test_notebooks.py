"""The research notebooks run top to bottom as written: every code cell in order, in one namespace, as
a kernel would run them (their cells assert what they show)."""
import json
import pathlib

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, default_model_path):   # the fixture skips, saying why, without the default model
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    assert cells, f"{path.name} has no code"
    namespace = {"__name__": "__main__"}
    for i, cell in enumerate(cells):
        exec(compile("".join(cell["source"]), f"{path.name} cell {i}", "exec"), namespace)
