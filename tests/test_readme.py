"""The README's Python example runs as written (on the emulated driver)."""

import re
from pathlib import Path


def test_readme_python_example_runs(capsys, monkeypatch):
    monkeypatch.setenv("Q12DRV_DRIVER", "emu")
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "the README has no python example"
    for code in blocks:
        exec(compile(code, "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "batched admitted" in out and "admitted" in out and "[ 0 37 87]" in out
