"""The README's Python examples type-check under ``mypy --strict`` with the project's settings.

An embedder's first code is copied from the README: it must use names ``import pdkv`` has, with the
types they have. The names an example leaves to the reader (``room``, ``chunk_pages``, ...) are
declared with their types in a preamble, never with ``Any`` where pdkv has a type."""

from __future__ import annotations

import re
from pathlib import Path

from mypy import api

ROOT = Path(__file__).resolve().parents[1]

PREAMBLE = """\
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

import pdkv

cp: int
room: pdkv.RoomId
num_pages: int
aux_row: int | None
kv_pool: list[torch.Tensor]
chunk_pages: npt.NDArray[np.int64]
start: int
is_last: bool
state: list[pdkv.StateIndices]
layer_id: int
cuda_event: Any  # a torch.cuda.Event on GPU
decode_layout: pdkv.BufferLayout
backend: pdkv.TransferBackend
dst_pages: npt.NDArray[np.int64]
state_indices: list[pdkv.StateIndices]
layout: pdkv.BufferLayout
buffer_tensors: list[torch.Tensor]
prefill_config: pdkv.PrefillConfig
"""


def _examples() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_readme_python_examples_pass_mypy_strict(tmp_path: Path) -> None:
    examples = _examples()
    assert examples, "the README has no Python example"
    files = []
    for i, example in enumerate(examples):
        path = tmp_path / f"readme_example_{i}.py"
        path.write_text(PREAMBLE + "\n" + example)
        files.append(str(path))
    # A planted mistake in the same run proves the check can fail: a plain str where pdkv wants an
    # InstanceId (the README's first example once made exactly this mistake).
    planted = tmp_path / "planted.py"
    planted.write_text(
        PREAMBLE + '\npdkv.PrefillConfig(instance="prefill-0", rank=pdkv.RankCoord(tp=0), tp_size=1,\n'
        '                  layout=decode_layout, registry="tcp://x:1")\n'
    )
    stdout, stderr, _ = api.run(
        [
            "--config-file",
            str(ROOT / "mypy.ini"),
            "--no-incremental",
            "--no-error-summary",
            *files,
            str(planted),
        ]
    )
    errors = [line for line in stdout.splitlines() if ": error:" in line]
    assert [e for e in errors if not e.startswith(str(planted))] == [], stdout + stderr
    assert any("InstanceId" in e for e in errors), stdout + stderr
