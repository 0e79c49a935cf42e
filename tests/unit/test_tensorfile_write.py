"""The tensor file written with hashing in a second thread and early writeback: same bytes, same checksum."""

from __future__ import annotations

import io
import itertools
from pathlib import Path

import pytest
import torch

from skipinject.payload import Payload
from skipinject.store import StepStore, tensorfile
from skipinject.store.checksums import _digest


def tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {
        "0:a": torch.randint(0, 1000, (257, 33), generator=gen),
        "1:empty": torch.empty(0, dtype=torch.float32),
        "2:b": torch.rand(1001, generator=gen),
        "3:c": torch.ones(5, dtype=torch.bool),
    }


@pytest.mark.parametrize("algo", ["xxh3_64-tree", "crc32"])
def test_overlapped_write_gives_the_same_file_and_checksum(monkeypatch: pytest.MonkeyPatch, algo: str) -> None:
    pytest.importorskip("xxhash")
    plain = io.BytesIO()
    expected = tensorfile.tensor_file(plain, tensors(), algo, None)[0]
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(tensorfile, "_OVERLAP_MIN_BYTES", 1)
    monkeypatch.setattr(tensorfile, "_WRITEBACK_STEP", 4096)
    monkeypatch.setattr(tensorfile, "_writeback_starter", lambda handle: lambda off, n: calls.append((off, n)))
    overlapped = io.BytesIO()
    assert tensorfile.tensor_file(overlapped, tensors(), algo, None)[0] == expected
    assert overlapped.getvalue() == plain.getvalue()
    assert calls and calls[0][0] == 0 and all(a + n == b for (a, n), (b, _) in itertools.pairwise(calls))


def test_store_round_trip_through_the_overlapped_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tensorfile, "_OVERLAP_MIN_BYTES", 1)
    monkeypatch.setattr(tensorfile, "_WRITEBACK_STEP", 4096)  # real sync_file_range on Linux
    store = StepStore(tmp_path, "rollout", {})
    store.save(1, Payload(tensors=tensors(), objects={"x": 1}, rows=None), {})
    entry = store.verified(1)
    [part] = store.load(entry)
    for name, tensor in tensors().items():
        assert torch.equal(part.tensors[name], tensor)
    [path] = store.step_dir(1).glob("tensors-*")
    assert (
        _digest(path.read_bytes(), store.checksum_algo)
        == store.read_meta(1)["parts"][0]["files"]["tensors"]["checksum"]
    )


def test_a_step_without_tensors_is_saved_and_served_without_importing_torch(tmp_path: Path) -> None:
    """A role whose results hold no tensors (the toy example's JSON) never pays for torch's import (seconds):
    not when its step is saved, nor when it is verified and loaded in a fresh process."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from skipinject.payload import Payload\n"
        "from skipinject.store import StepStore\n"
        f"store = StepStore(Path({str(tmp_path)!r}), 'toy', {{}})\n"
        "if sys.argv[1] == 'save':\n"
        "    store.save(1, Payload(objects={'result': {'responses': ['a', 'b']}}, rows=2))\n"
        "else:\n"
        "    (payload,) = store.load(store.verified(1))\n"
        "    assert payload.objects == {'result': {'responses': ['a', 'b']}}, payload.objects\n"
        "print(sorted(name for name in ('torch', 'tensordict') if name in sys.modules))\n"
    )
    for stage in ("save", "load"):
        done = subprocess.run([sys.executable, "-c", code, stage], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "[]", (stage, done.stdout)
