"""Compressed steps (issue 25): zstd in independent frames, exact compact encodings, bombs refused.

Every round trip compares every tensor bit for bit (dtype, shape, values) with what was saved.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import struct
import subprocess
import sys
import uuid
import warnings
from pathlib import Path
from typing import Any

import pytest

from skipinject.cache_tool.common import human_size
from skipinject.config import role_config
from skipinject.errors import ConfigError, CorruptCacheError
from skipinject.store import Payload, RemoteStepStore, StepStore, format
from skipinject.store.compression import (
    Compression,
    compression_for,
    parse_compression,
)
from skipinject.store.hit_memory import anonymous
from skipinject.store.mounts import is_network_path
from skipinject.store.remote import open_remote
from skipinject.verl.codecs import CONCATS
from tests.conftest import ROOT

torch = pytest.importorskip("torch")
zstandard = pytest.importorskip("zstandard")

PAD = 151_643


def padded_batch(rows: int = 16, prompt: int = 24, response: int = 40, seed: int = 0) -> dict[str, Any]:
    """verl's rollout tensors: prompts left-padded, responses right-padded, masks and position ids as verl
    builds them."""
    gen = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(1, prompt + 1, (rows,), generator=gen)
    response_lens = torch.randint(0, response + 1, (rows,), generator=gen)
    prompts = torch.full((rows, prompt), PAD, dtype=torch.int64)
    responses = torch.full((rows, response), PAD, dtype=torch.int64)
    prompt_mask = torch.zeros(rows, prompt, dtype=torch.int64)
    response_mask = torch.zeros(rows, response, dtype=torch.int64)
    for row in range(rows):
        p, r = int(prompt_lens[row]), int(response_lens[row])
        prompts[row, prompt - p :] = torch.randint(0, 151_000, (p,), generator=gen)
        responses[row, :r] = torch.randint(0, 151_000, (r,), generator=gen)
        prompt_mask[row, prompt - p :] = 1
        response_mask[row, :r] = 1
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    # vLLM rollout: positions continue through the response padding; agent loop: cumsum of the mask.
    prompt_pos = torch.clip(torch.cumsum(prompt_mask, dim=-1) - 1, min=0)
    delta = torch.arange(1, response + 1).expand(rows, response)
    position_ids = torch.cat([prompt_pos, prompt_pos[:, -1:] + delta], dim=1)
    return {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "agent_position_ids": torch.clip(torch.cumsum(attention_mask, dim=-1) - 1, min=0),
        "response_mask": response_mask,
        "rollout_log_probs": -torch.rand(rows, response, generator=gen) * response_mask,
        "bool_mask": attention_mask.bool(),
    }


def assert_same(loaded: dict[str, Any], saved: dict[str, Any]) -> None:
    assert list(loaded) == list(saved)
    for name, tensor in saved.items():
        got = loaded[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        assert torch.equal(got, tensor), name
        assert got.is_contiguous(), name


ZSTD = Compression()


def _store(root: Path, compression: Compression | None = ZSTD) -> StepStore:
    return StepStore(root / "project", "toy", {"run": 1}, compression=compression)


def _index(store: StepStore, step: int) -> list[dict[str, Any]]:
    """The tensor file's index, decompressed by hand."""
    meta = json.loads((store.step_dir(step) / "meta.json").read_text())
    spec = meta["parts"][0]["files"]["tensors"]
    raw = (store.step_dir(step) / spec["name"]).read_bytes()
    if "encoding" in spec:
        raw = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(raw), read_across_frames=True).read()
    (length,) = struct.unpack_from("<Q", raw, 8)
    return json.loads(raw[16 : 16 + length])["tensors"]


def _load(store: StepStore, step: int) -> Payload:
    (part,) = store.load(store.verified(step))
    return part


# ---------------------------------------------------------------- round trips


def test_a_compressed_step_loads_bit_for_bit_and_is_smaller(tmp_path: Path) -> None:
    tensors = padded_batch()
    plain, packed = _store(tmp_path / "a", None), _store(tmp_path / "b")
    for store in (plain, packed):
        store.save(1, Payload(concats=CONCATS, tensors=dict(tensors), objects={"v": [1, 2, 3]}, rows=16))
    sizes = {}
    for name, store in (("plain", plain), ("packed", packed)):
        part = _load(store, 1)
        assert_same(part.tensors, tensors)
        assert part.objects == {"v": [1, 2, 3]}
        meta = json.loads((store.step_dir(1) / "meta.json").read_text())
        sizes[name] = sum(f["size"] for f in meta["parts"][0]["files"].values())
        assert meta["format_version"] == (3 if name == "packed" else 2)
        files = meta["parts"][0]["files"]
        assert all(("encoding" in f) is (name == "packed") for f in files.values())
    assert sizes["packed"] * 5 < sizes["plain"]


def test_the_derivable_tensors_are_rebuilt_and_the_rest_stored_narrowed(tmp_path: Path) -> None:
    tensors = padded_batch()
    store = _store(tmp_path)
    store.save(1, Payload(concats=CONCATS, tensors=tensors, objects={}, rows=16))
    index = {entry["name"]: entry for entry in _index(store, 1)}
    assert index["input_ids"]["derive"] == {"concat": ["prompts", "responses"]}
    for name in ("attention_mask", "response_mask", "bool_mask"):
        assert "run" in index[name]["derive"], name
    for name in ("position_ids", "agent_position_ids"):
        assert "ramp" in index[name]["derive"], name
    assert index["prompts"]["stored_dtype"] == "int32" and index["prompts"]["dtype"] == "int64"
    assert "derive" not in index["rollout_log_probs"] and "stored_dtype" not in index["rollout_log_probs"]
    assert_same(_load(store, 1).tensors, tensors)


def test_a_signed_tensor_whose_rows_are_negative_is_stored_not_derived(tmp_path: Path) -> None:
    """No ramp describes a row with no positive value (its top would be negative): the tensor is stored as it is."""
    tensors = {"offsets": -torch.arange(1, 13, dtype=torch.int64).view(3, 4), "mask": torch.zeros(3, 4)}
    store = _store(tmp_path)
    store.save(1, Payload(tensors=tensors, objects={}, rows=3))
    index = {entry["name"]: entry for entry in _index(store, 1)}
    assert "derive" not in index["offsets"] and index["offsets"]["stored_dtype"] == "int8"
    assert_same(_load(store, 1).tensors, tensors)


def test_a_concatenation_is_stored_as_such_only_where_the_codec_names_it(tmp_path: Path) -> None:
    """The store searches for no concatenation: ``input_ids`` is rebuilt from ``prompts`` and ``responses``
    because verl's codec names them (a TensorDict's, at any depth), and stored whole when nobody does."""
    from tensordict import TensorDict

    from skipinject.verl.codecs import TensorDictCodec

    tensors = padded_batch()
    unnamed = _store(tmp_path / "unnamed")
    unnamed.save(1, Payload(tensors=tensors, objects={}, rows=16))
    assert "derive" not in {entry["name"]: entry for entry in _index(unnamed, 1)}["input_ids"]
    td = TensorDict(tensors, batch_size=[16])
    nested = TensorDict({"inner": td.clone()}, batch_size=[16])
    for value in (td, {"tensordict": td, "keys": ["k"]}, nested):
        payload = TensorDictCodec().encode(value)
        ((whole, (left, right)),) = payload.concats.items()
        assert (whole, left, right) == tuple(
            next(n for n in payload.tensors if n.endswith(f"[{key!r}]"))
            for key in ("input_ids", "prompts", "responses")
        )
        store = _store(tmp_path / str(len(whole)) / type(value).__name__)
        store.save(1, payload)
        assert {entry["name"]: entry for entry in _index(store, 1)}[whole]["derive"] == {"concat": [left, right]}
        assert_same(_load(store, 1).tensors, payload.tensors)


def test_what_is_not_derivable_is_stored_as_it_is(tmp_path: Path) -> None:
    """Multi-modal (3-row) position ids, a mask with a hole (multi-turn tool output), an input_ids that is
    not prompts ++ responses, wide integers, empty tensors: stored, and loaded bit for bit."""
    tensors = padded_batch(rows=8)
    rows, seq = tensors["input_ids"].shape
    mrope = torch.arange(seq).expand(3, rows, seq).clone()
    mrope[1, :, 5:9] = 4  # image tokens: height/width positions stand still
    holed = tensors["response_mask"].clone()
    holed[:, 3] = 0
    holed[:, 0] = 1
    changed = tensors["input_ids"].clone()
    changed[2, -1] += 1
    odd = {
        "mrope_position_ids": mrope.permute(1, 0, 2).contiguous(),
        "holed_response_mask": holed,
        "input_ids": changed,
        "wide": torch.tensor([[1 << 40, -3]], dtype=torch.int64),
        "unsigned": torch.tensor([[0, 65535]], dtype=torch.int32),
        "small": torch.tensor([[-3, 30000, 7]], dtype=torch.int32),
        "empty": torch.zeros((0, 4), dtype=torch.int64),
        "scalar": torch.tensor(7, dtype=torch.int64),
        "halves": torch.rand(4, 4).half(),
    }
    saved = {**tensors, **odd}
    store = _store(tmp_path)
    store.save(1, Payload(concats=CONCATS, tensors=saved, objects={}, rows=8))
    index = {entry["name"]: entry for entry in _index(store, 1)}
    for name in ("mrope_position_ids", "holed_response_mask", "input_ids", "wide"):
        assert "derive" not in index[name], name
    assert "stored_dtype" not in index["wide"]
    assert "stored_dtype" not in index["unsigned"]  # needs its 32 bits
    assert index["small"]["stored_dtype"] == "int16" and "derive" not in index["small"]
    assert_same(_load(store, 1).tensors, saved)


def test_a_float_tensor_beyond_int64_saves_without_a_numpy_warning(tmp_path: Path) -> None:
    """Position ids are looked for in integer tensors only: a float's inf or 1e30 is never cast to int64."""
    saved = {"scores": torch.tensor([[float("inf"), 1.0], [0.0, 2.0]]), "big": torch.tensor([[1e30, 1.0]])}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _store(tmp_path).save(1, Payload(tensors=saved, objects={}, rows=2))
    assert_same(_load(_store(tmp_path), 1).tensors, saved)


def test_a_loaded_compressed_tensor_is_private_and_writable(tmp_path: Path) -> None:
    tensors = padded_batch()
    store = _store(tmp_path)
    store.save(1, Payload(concats=CONCATS, tensors=tensors, objects={}, rows=16))
    first = _load(store, 1).tensors
    first["rollout_log_probs"].add_(1.0)
    first["prompts"][0, 0] = 5
    assert_same(_load(store, 1).tensors, tensors)


def test_a_hit_decompresses_each_frame_straight_into_the_decoded_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No frame goes through a bytes object of its own (copied once more into place)."""

    real = zstandard.ZstdDecompressor

    class InPlaceOnly:
        def __init__(self) -> None:
            self.stream_reader = real().stream_reader

        def decompress(self, *args: Any, **kwargs: Any) -> bytes:
            raise AssertionError("a frame was decompressed into a new bytes object")

    tensors = padded_batch(rows=64, prompt=64, response=2048)
    store = _store(tmp_path)
    store.save(1, Payload(concats=CONCATS, tensors=tensors, objects={"k": 1}, rows=64))
    monkeypatch.setattr(zstandard, "ZstdDecompressor", InPlaceOnly)
    part = _load(store, 1)
    assert_same(part.tensors, tensors)
    assert part.objects == {"k": 1}


def test_restored_tensors_are_written_once_into_one_private_mapping(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Widened and derived tensors are built block by block, in threads, into one fresh mapping sized
    for exactly them (no tensor built twice, none allocated on its own), and keep every bit."""
    import skipinject.store.hit_memory as hit_memory
    import skipinject.store.tensorfile as tensorfile

    tensors = padded_batch(rows=64, prompt=24, response=40)
    store = _store(tmp_path)
    store.save(1, Payload(concats=CONCATS, tensors=tensors, objects={}, rows=64))
    index = {entry["name"]: entry for entry in _index(store, 1)}
    restored = [name for name, entry in index.items() if "derive" in entry or "stored_dtype" in entry]
    assert {"input_ids", "attention_mask", "position_ids", "prompts"} <= set(restored)
    arenas: list[int] = []

    def counted(size: int) -> Any:
        arenas.append(size)
        return anonymous(size)

    monkeypatch.setattr(hit_memory, "anonymous", counted)
    monkeypatch.setattr(tensorfile, "_THREADED_MIN_BYTES", 0)  # threads and many blocks even here
    monkeypatch.setattr(tensorfile, "BLOCK_ELEMENTS", 200)
    loaded = _load(store, 1).tensors
    assert_same(loaded, tensors)
    wanted = sum(-(-tensors[name].numel() * tensors[name].element_size() // 64) * 64 for name in restored)
    decoded = json.loads((store.step_dir(1) / "meta.json").read_text())["parts"][0]["files"]["tensors"]
    assert arenas == [decoded["decoded_size"], wanted]  # the decompressed file, then the restored tensors
    starts = sorted((loaded[name].data_ptr(), loaded[name].numel() * loaded[name].element_size()) for name in restored)
    assert starts[-1][0] + starts[-1][1] - starts[0][0] <= wanted  # all inside that one mapping
    loaded["input_ids"][0, 0] = -1  # private: nothing else changes with it
    assert torch.equal(loaded["prompts"], tensors["prompts"])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_the_decoded_file_is_private_anonymous_memory() -> None:
    """Not a shared (shmem) mapping, whose page faults cost more than a private one's."""
    import ctypes

    buffer = anonymous(8 << 20)
    holder = (ctypes.c_char * 1).from_buffer(buffer)
    address = ctypes.addressof(holder)
    del holder
    for line in Path("/proc/self/maps").read_text().splitlines():
        low, high = (int(x, 16) for x in line.split()[0].split("-"))
        if low <= address < high:
            assert line.split()[1] == "rw-p" and "/dev/zero" not in line, line
            break
    else:
        raise AssertionError("the mapping is not in /proc/self/maps")
    buffer.close()


def test_the_codec_result_round_trips_through_a_compressed_store(tmp_path: Path) -> None:
    """A real TensorDict result (the DataProto batch is one) through the codec and a compressed store."""
    tensordict = pytest.importorskip("tensordict")
    from skipinject.verl.codecs import TensorDictCodec

    tensors = padded_batch()
    td = tensordict.TensorDict(tensors, batch_size=[16])
    codec = TensorDictCodec()
    store = _store(tmp_path)
    store.save(1, codec.encode(td))
    loaded = codec.decode(_load(store, 1))
    assert_same({k: loaded[k] for k in tensors}, tensors)


def test_steps_of_either_kind_are_read_whatever_the_store_writes(tmp_path: Path) -> None:
    tensors = padded_batch()
    _store(tmp_path, None).save(1, Payload(concats=CONCATS, tensors=tensors, objects={}, rows=16))
    _store(tmp_path).save(2, Payload(concats=CONCATS, tensors=tensors, objects={}, rows=16))
    for compression in (None, Compression(), Compression(9)):
        for step in (1, 2):
            assert_same(_load(_store(tmp_path, compression), step).tensors, tensors)


FIXTURE = ROOT / "tests" / "data" / "format-v2"


def test_a_cache_written_by_the_previous_release_still_loads() -> None:
    """``tests/data/format-v2`` was written by the code before compression (format version 2)."""
    expected = padded_batch(rows=4, prompt=6, response=8)
    store = StepStore(FIXTURE, "toy", {"run": 1}, compression=Compression())
    part = _load(store, 1)
    assert_same(part.tensors, expected)
    assert part.objects == {"note": "written by skipinject before issue 25"}
    assert json.loads((FIXTURE / "1" / "meta.json").read_text())["format_version"] == 2


def test_a_remote_step_is_compressed_and_loads(tmp_path: Path) -> None:
    fs, root = open_remote(f"memory://skipinject-tests/{uuid.uuid4().hex}")
    store = RemoteStepStore(root / "project", "toy", {"run": 1}, fs, compression=compression_for("auto", root))
    assert store.compression == Compression()
    tensors = padded_batch()
    store.save(1, Payload(concats=CONCATS, tensors=tensors, objects={"v": 1}, rows=16))
    part = _load(store, 1)
    assert_same(part.tensors, tensors)
    assert part.objects == {"v": 1}


def test_a_batch_larger_than_a_frame_is_many_frames(tmp_path: Path) -> None:
    tensors = {"noise": torch.randint(0, 1 << 30, (3, format.FRAME_BYTES // 8), dtype=torch.int64)}
    store = _store(tmp_path)
    store.save(1, Payload(concats=CONCATS, tensors=tensors, objects={}, rows=3))
    meta = json.loads((store.step_dir(1) / "meta.json").read_text())
    spec = meta["parts"][0]["files"]["tensors"]
    assert len(spec["frames"]) == -(-spec["decoded_size"] // format.FRAME_BYTES) >= 2
    assert_same(_load(store, 1).tensors, tensors)


def _remote_store() -> StepStore:
    fs, root = open_remote(f"memory://skipinject-tests/{uuid.uuid4().hex}")
    return RemoteStepStore(root / "project", "toy", {"run": 1}, fs, compression=ZSTD)


def test_a_remote_hit_decodes_frames_while_the_download_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    """Frames are decompressed as their bytes arrive, in bounded requests; the stored file is never held whole."""
    import skipinject.store.compression as compression
    import skipinject.store.remote as remote

    store = _remote_store()
    noise = torch.randint(0, 1 << 30, (6, format.FRAME_BYTES // 8), dtype=torch.int64)  # 6 frames, incompressible
    tensors = {**padded_batch(), "noise": noise}
    store.save(1, Payload(concats=CONCATS, tensors=tensors, objects={"v": 1}, rows=16))
    events: list[tuple[str, int]] = []
    monkeypatch.setattr(remote, "STREAM_CHUNK", 1 << 20)

    def whole(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a compressed file was read whole before decoding")

    monkeypatch.setattr(remote._RemoteStep, "read", whole)
    real_feed, real_decode = compression.FrameDecoder.feed, compression.FrameDecoder._decode_frame

    def feed(self: Any, data: Any) -> None:
        events.append(("read", memoryview(data).nbytes))
        real_feed(self, data)

    def decode(self: Any, number: int, frame: Any) -> None:
        events.append(("decode", number))
        real_decode(self, number, frame)

    monkeypatch.setattr(compression.FrameDecoder, "feed", feed)
    monkeypatch.setattr(compression.FrameDecoder, "_decode_frame", decode)
    part = _load(store, 1)
    assert_same(part.tensors, tensors)
    assert part.objects == {"v": 1}
    reads = [i for i, (kind, _) in enumerate(events) if kind == "read"]
    decodes = [i for i, (kind, number) in enumerate(events) if kind == "decode" and number == 0]
    assert max(size for kind, size in events if kind == "read") <= 1 << 20
    assert len(reads) > 8 and decodes[0] < reads[-4]  # frame 0 decoded long before the last pieces came
    frames = sum(len(file.spec["frames"]) for _, file in store.read_meta(1).files())
    assert sum(1 for kind, _ in events if kind == "decode") == frames >= 4


@pytest.mark.parametrize(
    ("forge", "message"),
    [
        ("bomb", r"frame 0 claims 1073741824 decoded bytes, meta.json records 1048576"),
        ("liar", "frame 0 is damaged"),
        ("flip", "checksum mismatch"),
        ("short", "frame table does not match"),
    ],
)
def test_a_hostile_remote_file_is_refused_while_it_streams(forge: str, message: str) -> None:
    from skipinject.store.checksums import _digest

    store = _remote_store()
    store.save(1, Payload(concats=CONCATS, tensors=padded_batch(), objects={}, rows=16))
    fs = store.backend.fs  # type: ignore[attr-defined]
    meta_key = store.step_dir(1).path + "/meta.json"  # type: ignore[attr-defined]
    meta = json.loads(fs.cat_file(meta_key))
    spec = meta["parts"][0]["files"]["tensors"]
    key = store.step_dir(1).path + "/" + spec["name"]  # type: ignore[attr-defined]
    data = fs.cat_file(key)
    if forge == "flip":
        fs.pipe_file(key, data[:-1] + bytes([data[-1] ^ 1]))
    else:
        if forge == "bomb":
            data, decoded = _frame_claiming(bytes(1 << 20), 1 << 30), 1 << 20
        elif forge == "liar":
            data, decoded = _frame_claiming(bytes(1 << 20), 1000), 1000
        else:
            decoded = spec["decoded_size"] + format.FRAME_BYTES
        fs.pipe_file(key, data)
        frames = [len(data)] if forge != "short" else spec["frames"]
        spec.update(size=len(data), checksum=_digest(data, meta["checksum_algo"]), decoded_size=decoded, frames=frames)
        meta["meta_checksum"] = format.meta_digest(meta)
        fs.pipe_file(meta_key, json.dumps(meta).encode())
    with pytest.raises(CorruptCacheError, match=message):
        store.verified(1)


# ---------------------------------------------------------------- hostile files


def _saved(tmp_path: Path, tensors: dict[str, Any] | None = None) -> tuple[StepStore, Path, dict[str, Any]]:
    store = _store(tmp_path)
    store.save(1, Payload(concats=CONCATS, tensors=tensors or padded_batch(), objects={}, rows=16))
    meta_path = store.step_dir(1) / "meta.json"
    return store, meta_path, json.loads(meta_path.read_text())


def _rewrite(meta_path: Path, meta: dict[str, Any]) -> None:
    meta["meta_checksum"] = format.meta_digest(meta)
    meta_path.write_text(json.dumps(meta))


def _replace_tensor_file(store: StepStore, meta_path: Path, meta: dict[str, Any], data: bytes, **record: Any) -> None:
    from skipinject.store.checksums import _digest

    spec = meta["parts"][0]["files"]["tensors"]
    (store.step_dir(1) / spec["name"]).write_bytes(data)
    spec.update(size=len(data), checksum=_digest(data, meta["checksum_algo"]), **record)
    _rewrite(meta_path, meta)


def _frame_claiming(data: bytes, claimed: int) -> bytes:
    """A zstd frame of ``data`` whose header claims ``claimed`` decoded bytes (4-byte content size field)."""
    frame = bytearray(zstandard.ZstdCompressor(level=3, write_content_size=True).compress(data))
    descriptor = frame[4]
    assert descriptor >> 6 == 2 and descriptor & 3 == 0, "expected a 4-byte content size, no dictionary"
    at = 5 + (0 if descriptor & 0x20 else 1)
    frame[at : at + 4] = struct.pack("<I", claimed)
    assert zstandard.frame_content_size(bytes(frame)) == claimed
    return bytes(frame)


def test_a_frame_claiming_more_than_its_recorded_size_is_refused_before_decompression(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, meta_path, meta = _saved(tmp_path)
    bomb = _frame_claiming(bytes(1 << 20), 1 << 30)
    _replace_tensor_file(store, meta_path, meta, bomb, decoded_size=1 << 20, frames=[len(bomb)])
    sizes: list[int] = []
    real = zstandard.ZstdDecompressor.stream_reader
    monkeypatch.setattr(
        zstandard.ZstdDecompressor,
        "stream_reader",
        lambda *a, **k: sizes.append(memoryview(a[1]).nbytes) or real(*a, **k),
    )
    with pytest.raises(CorruptCacheError, match=r"frame 0 claims 1073741824 decoded bytes, meta.json records 1048576"):
        store.verified(1)
    assert len(bomb) not in sizes  # the objects file's frame was decompressed, the bomb never


def test_a_frame_expanding_beyond_what_it_claims_is_refused(tmp_path: Path) -> None:
    store, meta_path, meta = _saved(tmp_path)
    liar = _frame_claiming(bytes(1 << 20), 1000)
    _replace_tensor_file(store, meta_path, meta, liar, decoded_size=1000, frames=[len(liar)])
    with pytest.raises(CorruptCacheError, match="frame 0 is damaged"):
        store.verified(1)


def test_a_frame_without_a_content_size_is_refused(tmp_path: Path) -> None:
    store, meta_path, meta = _saved(tmp_path)
    frame = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(1000))
    _replace_tensor_file(store, meta_path, meta, frame, decoded_size=1000, frames=[len(frame)])
    with pytest.raises(CorruptCacheError, match="frame 0 claims -1 decoded bytes"):
        store.verified(1)


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"decoded_size": 1 << 50}, "declares 1125899906842626 decoded bytes, more than its 16 rows may take"),
        ({"decoded_size": 5 << 20}, "does not match its decoded size"),
        ({"decoded_size": 1 << 20, "frames": "many"}, "no valid decoded size or frame table"),
        ({"frames": None}, "no valid decoded size or frame table"),
        ({"encoding": "lz4"}, "unknown encoding"),
    ],
)
def test_a_forged_frame_table_is_refused_before_allocating(
    tmp_path: Path, record: dict[str, Any], message: str
) -> None:
    store, meta_path, meta = _saved(tmp_path)
    meta["parts"][0]["files"]["tensors"].update(record)
    _rewrite(meta_path, meta)
    with pytest.raises(CorruptCacheError, match=message):
        store.verified(1)


def test_a_file_claiming_more_than_zstd_can_expand_is_refused(tmp_path: Path) -> None:
    store, meta_path, meta = _saved(tmp_path)
    frames = 64
    decoded = frames * format.FRAME_BYTES
    tiny = b"\x28\xb5\x2f\xfd" * frames  # 4 bytes a frame: far below what 4 MiB can shrink to
    _replace_tensor_file(store, meta_path, meta, tiny, decoded_size=decoded, frames=[4] * frames)
    with pytest.raises(CorruptCacheError, match="more than zstd's 32768x"):
        store.verified(1)


def test_a_damaged_stored_byte_is_a_checksum_mismatch(tmp_path: Path) -> None:
    store, _, meta = _saved(tmp_path)
    path = store.step_dir(1) / meta["parts"][0]["files"]["tensors"]["name"]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCacheError, match="checksum mismatch"):
        store.verified(1)


def _forged_index(entries: list[dict[str, Any]]) -> bytes:
    header = json.dumps({"tensors": entries}).encode()
    header += b" " * (-(16 + len(header)) % 64)
    return format.TENSORS_MAGIC + struct.pack("<Q", len(header)) + header


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"name": "m", "dtype": "int64", "shape": [1 << 20, 1 << 20], "derive": {"run": [0], "end": [1]}}, "rebuilds"),
        ({"name": "m", "dtype": "int64", "shape": [2, 3], "derive": {"run": [0], "end": [1]}}, "one integer per row"),
        ({"name": "m", "dtype": "int64", "shape": [2, 3], "derive": {"concat": ["a", "b"]}}, "does not hold"),
        ({"name": "m", "dtype": "int64", "shape": [2, 3], "derive": {"exec": "rm -rf"}}, "unknown recipe"),
        ({"name": "m", "dtype": "int64", "shape": [1, 3], "derive": {"ramp": [0], "top": [-1]}}, "negative top"),
        ({"name": "m", "dtype": "int64", "shape": [1, 3], "derive": {"ramp": [-(1 << 70)], "top": [9]}}, "damaged"),
        ({"name": "m", "dtype": "int16", "shape": [1, 3], "derive": {"ramp": [0], "top": [1 << 40]}}, "damaged"),
        ({"name": "m", "dtype": "float32", "shape": [1], "offset": 0, "nbytes": 1, "stored_dtype": "uint8"}, "stored"),
        # issue 37: every recipe checked whole against its shape and dtype
        ({"name": "m", "dtype": "int64", "shape": [2, 3], "derive": {"run": [2, 0], "end": [1, 3]}}, "outside its row"),
        ({"name": "m", "dtype": "int64", "shape": [2, 3], "derive": {"run": [-1, 0], "end": [1, 3]}}, "outside"),
        ({"name": "m", "dtype": "bool", "shape": [2, 3], "derive": {"run": [0, 0], "end": [4, 3]}}, "outside its row"),
        ({"name": "m", "dtype": "int64", "shape": [1, 3], "derive": {"run": [0], "end": [1 << 70]}}, "outside its row"),
        ({"name": "m", "dtype": "int64", "shape": [1, 3], "derive": {"ramp": [3], "top": [1]}}, "starting outside"),
        ({"name": "m", "dtype": "int64", "shape": [1, 3], "derive": {"ramp": [-5], "top": [1]}}, "starting outside"),
        ({"name": "m", "dtype": "int8", "shape": [1, 3], "derive": {"ramp": [0], "top": [300]}}, "does not hold"),
        ({"name": "m", "dtype": "float32", "shape": [1, 3], "derive": {"ramp": [0], "top": [2]}}, "a ramp of float32"),
        ({"name": "m", "dtype": "int64", "shape": [0, 3], "derive": {"run": [], "end": []}}, "a run of shape"),
        ({"name": "m", "dtype": "int16", "shape": [1], "offset": 0, "nbytes": 4, "stored_dtype": "int32"}, "stored"),
    ],
)
def test_a_forged_compact_index_is_refused(tmp_path: Path, entry: dict[str, Any], message: str) -> None:
    store, meta_path, meta = _saved(tmp_path)
    raw = _forged_index([entry]) + bytes(64)
    hasher_data = zstandard.ZstdCompressor(write_content_size=True).compress(raw)
    _replace_tensor_file(store, meta_path, meta, hasher_data, decoded_size=len(raw), frames=[len(hasher_data)])
    entry_obj = store.verified(1)
    with pytest.raises(CorruptCacheError, match=message):
        store.load(entry_obj)


# ---------------------------------------------------------------- absolute bounds (issue 37)

WIDE = {"prompt_length": 8, "response_length": 8}  # a layout's widths: 16 tokens a row


def _zeros_bomb(decoded: int, entries: list[dict[str, Any]]) -> tuple[bytes, list[int]]:
    """A genuine compressed tensor file: a real index, then ``decoded`` bytes of zeros, in real zstd
    frames (about 29,000x: within zstd's ratio); its stored bytes and frame table."""
    head = _forged_index(entries)
    compressor = zstandard.ZstdCompressor(level=19, write_content_size=True)
    zeros = compressor.compress(bytes(format.FRAME_BYTES))
    total = len(head) + decoded
    frames = [compressor.compress(head + bytes(format.FRAME_BYTES - len(head)))]
    whole, rest = divmod(total - format.FRAME_BYTES, format.FRAME_BYTES)
    frames += [zeros] * whole + ([compressor.compress(bytes(rest))] if rest else [])
    return b"".join(frames), [len(frame) for frame in frames]


def test_a_genuine_zstd_bomb_is_refused_before_a_frame_is_decoded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 256 MiB tensor of zeros in real zstd frames (a few KB), claiming 4 rows of 16 tokens: refused
    from meta.json alone (it declares more than 4 rows can take), before anything is allocated."""
    store = StepStore(tmp_path / "project", "toy", WIDE, compression=ZSTD)
    store.save(1, Payload(tensors=padded_batch(4, 8, 8), objects={}, rows=4))
    meta_path = store.step_dir(1) / "meta.json"
    meta = json.loads(meta_path.read_text())
    decoded = 256 << 20
    tensor = {"name": "x", "dtype": "uint8", "shape": [4, decoded // 4], "offset": 0, "nbytes": decoded}
    bomb, frames = _zeros_bomb(decoded, [tensor])
    assert len(bomb) < decoded / 20_000
    size = len(_forged_index([tensor])) + decoded
    _replace_tensor_file(store, meta_path, meta, bomb, decoded_size=size, frames=frames)
    allocated: list[int] = []
    monkeypatch.setattr("skipinject.store.hit_memory.anonymous", lambda size: allocated.append(size) or bytearray(size))
    with pytest.raises(CorruptCacheError, match=r"declares \d+ decoded bytes, more than its 4 rows may take"):
        store.verified(1)
    assert allocated == []


def test_a_step_beyond_the_memory_budget_is_refused_even_without_a_layout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from skipinject.store import hit_memory

    store, _, meta = _saved(tmp_path)
    decoded = sum(spec.get("decoded_size", spec["size"]) for spec in meta["parts"][0]["files"].values())
    monkeypatch.setattr(hit_memory, "_USABLE", [2 * decoded - 2])
    with pytest.raises(CorruptCacheError, match="more than this process may spend on a step"):
        store.verified(1)
    monkeypatch.setattr(hit_memory, "_USABLE", [2 * decoded + (1 << 20)])  # room for the rebuilt tensors
    assert_same(_load(store, 1).tensors, padded_batch())


def test_a_compact_rebuild_beyond_the_declared_rows_is_refused_before_it_allocates(tmp_path: Path) -> None:
    """A few hundred bytes whose index rebuilds a [4, 2^20] int64 mask (32 MiB) for 4 rows of 16 tokens."""
    store = StepStore(tmp_path / "project", "toy", WIDE, compression=ZSTD)
    store.save(1, Payload(tensors=padded_batch(4, 8, 8), objects={}, rows=4))
    meta_path = store.step_dir(1) / "meta.json"
    meta = json.loads(meta_path.read_text())
    width = format.MAX_WIDTH
    entry = {"name": "m", "dtype": "int64", "shape": [4, width], "derive": {"run": [0] * 4, "end": [width] * 4}}
    raw = _forged_index([entry])
    stored = zstandard.ZstdCompressor(write_content_size=True).compress(raw)
    _replace_tensor_file(store, meta_path, meta, stored, decoded_size=len(raw), frames=[len(stored)])
    verified = store.verified(1)
    with pytest.raises(CorruptCacheError, match="more than the step's rows may take"):
        store.load(verified)


def test_the_writer_never_saves_a_part_no_reader_would_load(tmp_path: Path) -> None:
    from skipinject.errors import CacheError

    store = StepStore(tmp_path / "project", "toy", WIDE, compression=ZSTD)
    with pytest.raises(CacheError, match="more than a reader loads"):
        store.save(1, Payload(tensors={"x": torch.zeros(1, 5 << 20)}, objects={}, rows=1))
    assert not store.step_dir(1).exists() or not any(store.step_dir(1).iterdir())


def test_memory_a_refused_step_took_is_not_kept_by_hit_memory(tmp_path: Path) -> None:
    """The decoded file came from the pool, then its index was refused: the pool lets it go."""
    from skipinject.store.hit_memory import HitMemory

    memory = HitMemory()
    store = StepStore(tmp_path / "project", "toy", {"run": 1}, compression=ZSTD, memory=memory)
    store.save(1, Payload(concats=CONCATS, tensors=padded_batch(), objects={}, rows=16))
    meta_path = store.step_dir(1) / "meta.json"
    meta = json.loads(meta_path.read_text())
    raw = _forged_index([{"name": "m", "dtype": "int64", "shape": [1, 3], "derive": {"run": [2], "end": [1]}}])
    raw += bytes(1 << 20)
    stored = zstandard.ZstdCompressor(write_content_size=True).compress(raw)
    _replace_tensor_file(store, meta_path, meta, stored, decoded_size=len(raw), frames=[len(stored)])
    entry = store.verified(1)
    assert memory.nbytes >= 1 << 20
    with pytest.raises(CorruptCacheError, match="outside its row"):
        store.load(entry)
    assert memory.nbytes == 0


def test_a_step_that_cannot_be_allocated_is_a_corrupt_cache_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever fails while a step is read (here the memory for its decoded file) is a CorruptCacheError,
    so ``strict`` stops with it and ``cache`` regenerates: never a bare MemoryError."""
    from skipinject.store import hit_memory

    store, _, _ = _saved(tmp_path)

    def no_memory(size: int) -> Any:
        raise MemoryError

    monkeypatch.setattr(hit_memory, "anonymous", no_memory)
    with pytest.raises(CorruptCacheError, match="MemoryError"):
        store.verified(1)


# ---------------------------------------------------------------- the setting


def test_the_setting_names_none_zstd_and_levels() -> None:
    assert parse_compression("none") is None
    assert parse_compression("zstd") == Compression(1) == parse_compression("zstd-1")
    assert parse_compression("zstd-19") == Compression(19)
    assert parse_compression("auto") is None
    assert parse_compression("auto", remote=True) == Compression(1)
    assert parse_compression("auto", network_fs=True) == Compression(1)
    assert role_config("rollout", {"compression": "zstd-7"}).compression == "zstd-7"
    for bad in ("gzip", "zstd-0", "zstd-23", "ZSTD", ""):
        with pytest.raises(ConfigError, match=r"skip.rollout.compression=.*expected auto, none, zstd or zstd-1"):
            role_config("rollout", {"compression": bad})


def test_auto_compresses_object_stores_and_network_file_systems_only(tmp_path: Path) -> None:
    shared, fuse, near = tmp_path / "shared", tmp_path / "fuse", tmp_path / "sharedx"
    for directory in (shared, fuse, near):
        directory.mkdir()
    mounts = "\n".join(
        f"{n} 1 0:1 / {point} rw - {kind} src rw"
        for n, (point, kind) in enumerate(
            [("/", "ext4"), (shared.resolve(), "nfs4"), (fuse.resolve(), "fuse.sshfs"), (near.resolve(), "fuse.lxcfs")]
        )
    )
    assert is_network_path(shared / "dump", mounts)
    assert is_network_path(fuse, mounts)
    assert not is_network_path(near, mounts), "one classifier: a local FUSE mount is no network file system"
    assert not is_network_path("/home/me", mounts)
    assert is_network_path("/x", "") is None
    _, root = open_remote("memory://skipinject-tests/auto")
    assert compression_for("auto", root) == Compression()
    assert compression_for("none", root) is None
    assert compression_for("zstd-5", tmp_path) == Compression(5)


def test_zstandard_is_imported_only_for_compressed_steps(tmp_path: Path) -> None:
    script = f"""
import sys, torch
from pathlib import Path
from skipinject.store import Payload, StepStore
from skipinject.store.compression import Compression
import skipinject.config, skipinject.engine
plain = StepStore(Path({str(tmp_path)!r}) / "p", "toy", {{}})
plain.save(1, Payload(tensors={{"x": torch.ones(3)}}, objects={{}}, rows=1))
plain.load(plain.verified(1))
assert "zstandard" not in sys.modules, "imported for a plain step"
packed = StepStore(Path({str(tmp_path)!r}) / "z", "toy", {{}}, compression=Compression())
packed.save(1, Payload(tensors={{"x": torch.ones(3)}}, objects={{}}, rows=1))
assert "zstandard" in sys.modules
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=False)
    assert done.returncode == 0, done.stderr


# ---------------------------------------------------------------- skipinject cache compact


def _layout_store(dump: Path, compression: Compression | None = None) -> StepStore:
    return StepStore(dump / "exp_proj" / "GBS16_N2_in24_out40", "rollout", {"run": 1}, compression=compression)


def test_cache_compact_stores_old_steps_compressed_and_keeps_what_they_hold(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from skipinject.cache_tool import main

    dump = tmp_path / "dump"
    store = _layout_store(dump)
    tensors = padded_batch()
    for step in (1, 2):
        store.save(
            step,
            Payload(concats=CONCATS, tensors=tensors, objects={"step": step}, rows=16),
            {"trajectories": step * 10},
        )
    before = {step: json.loads((store.step_dir(step) / "meta.json").read_text()) for step in (1, 2)}
    assert main(["compact", str(dump), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.count(f"would compact {dump}") == 2 and "would compact 2 step(s), " in out.splitlines()[-1]
    assert all(json.loads((store.step_dir(s) / "meta.json").read_text()) == before[s] for s in (1, 2))

    assert main(["compact", str(dump), "--compression", "zstd-5"]) == 0
    out = capsys.readouterr().out
    assert out.count(f"compacted {dump}") == 2 and "% of it)" in out, out
    assert out.splitlines()[-1].startswith("compacted 2 step(s), ") and "% of it); 0 already" in out, out
    for step in (1, 2):
        meta = json.loads((store.step_dir(step) / "meta.json").read_text())
        assert meta["format_version"] == 3 and meta["trajectories"] == step * 10
        assert meta["created"] == before[step]["created"]
        assert all(spec["encoding"] == "zstd" for spec in meta["parts"][0]["files"].values())
        names = {spec["name"] for spec in meta["parts"][0]["files"].values()}
        assert names.isdisjoint(spec["name"] for spec in before[step]["parts"][0]["files"].values())
        part = _load(store, step)
        assert_same(part.tensors, tensors)
        assert part.objects == {"step": step}
    assert main(["compact", str(dump)]) == 0
    out = capsys.readouterr().out
    assert out.count("already compressed ") == 2 and "compacted 0 step(s); 2 already compressed, 0 failed" in out
    assert main(["ls", str(dump), "--json"]) == 0
    records = json.loads(capsys.readouterr().out)["steps"]
    assert all(r["decoded"] > r["size"] for r in records), records
    assert main(["ls", str(dump), "-l"]) == 0
    assert capsys.readouterr().out.count(" decoded)") == 3  # two steps and the total line


def test_cache_compact_leaves_a_step_it_cannot_read_as_it_was(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from skipinject.cache_tool import main

    dump = tmp_path / "dump"
    store = _layout_store(dump)
    store.save(1, Payload(concats=CONCATS, tensors=padded_batch(), objects={}, rows=16))
    meta = json.loads((store.step_dir(1) / "meta.json").read_text())
    data = store.step_dir(1) / meta["parts"][0]["files"]["tensors"]["name"]
    damaged = bytearray(data.read_bytes())
    damaged[-1] ^= 1
    data.write_bytes(bytes(damaged))
    files = sorted(p.name for p in store.step_dir(1).iterdir())
    assert main(["compact", str(dump)]) == 1
    assert "failed" in capsys.readouterr().out
    assert sorted(p.name for p in store.step_dir(1).iterdir()) == files
    assert json.loads((store.step_dir(1) / "meta.json").read_text()) == meta


def test_jagged_tensors_round_trip_through_a_compressed_store(tmp_path: Path) -> None:
    """verl's V1 batches: jagged values and offsets (narrowed, then restored to int64)."""
    tensordict = pytest.importorskip("tensordict")
    from skipinject.verl.codecs import TensorDictCodec

    lengths = torch.tensor([3, 0, 5, 2])
    offsets = torch.zeros(5, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    values = torch.randint(0, 151_000, (int(offsets[-1]),), dtype=torch.int64)
    jagged = torch.nested.nested_tensor_from_jagged(values, offsets=offsets)
    td = tensordict.TensorDict({"responses": jagged}, batch_size=[4])
    codec = TensorDictCodec()
    store = _store(tmp_path)
    store.save(1, codec.encode(td))
    loaded = codec.decode(_load(store, 1))["responses"]
    assert loaded.values().dtype == torch.int64 and torch.equal(loaded.values(), values)
    assert loaded.offsets().dtype == torch.int64 and torch.equal(loaded.offsets(), offsets)


def test_cache_show_prints_stored_and_decoded_sizes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from skipinject.cache_tool import main

    dump = tmp_path / "dump"
    plain, packed = _layout_store(dump), _layout_store(dump, ZSTD)
    plain.save(1, Payload(concats=CONCATS, tensors=padded_batch(), objects={}, rows=16))
    packed.save(2, Payload(concats=CONCATS, tensors=padded_batch(), objects={}, rows=16))
    sizes = {}
    for step, store in ((1, plain), (2, packed)):
        files = json.loads((store.step_dir(step) / "meta.json").read_text())["parts"][0]["files"].values()
        stored = sum(spec["size"] for spec in files)
        decoded = sum(spec.get("decoded_size", spec["size"]) for spec in files)
        assert main(["show", str(store.step_dir(step)), "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert (doc["size"], doc["decoded_size"]) == (stored, decoded)
        assert main(["show", str(store.step_dir(step))]) == 0
        sizes[step] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  size ")]
    assert sizes[1] == [f"  size {human_size(stored_of(plain, 1))} stored"], sizes
    assert len(sizes[2]) == 1 and sizes[2][0].endswith(" decoded)") and decoded > stored, sizes


def stored_of(store: StepStore, step: int) -> int:
    return store.read_meta(step).stored_size


def test_a_hit_writes_no_zeros_into_the_fresh_memory_of_masks_and_position_ids() -> None:
    """Fresh anonymous memory reads as zeros: the rebuilt padding is left untouched (its pages never
    faulted in), and only a buffer not known to be zero gets its zeros written."""
    from skipinject.store.tensorfile import Recipe

    tensors = padded_batch()
    for name, key in (("attention_mask", "run"), ("position_ids", "ramp")):
        entry = {"name": name, "dtype": "int64", "shape": list(tensors[name].shape)}
        (spec,) = [e["derive"] for e in _plan_index(tensors) if e["name"] == name]
        assert key in spec
        recipe = Recipe.of({**entry, "derive": spec}, {}, torch.int64)
        sentinel = torch.full(tensors[name].shape, -7, dtype=torch.int64)  # a value neither holds
        for rows in recipe.blocks():
            recipe.write(sentinel, rows, zeroed=True)
        zeros, untouched = tensors[name] == 0, sentinel == -7
        assert bool(zeros[untouched].all()), name  # only zeros left unwritten
        assert int(untouched.sum()) >= int(zeros.sum()) - len(zeros) > 0, name  # all but a ramp's first 0 a row
        assert torch.equal(sentinel[~untouched], tensors[name][~untouched]), name
        for rows in recipe.blocks():
            recipe.write(sentinel, rows)
        assert torch.equal(sentinel, tensors[name]), name


def _plan_index(tensors: dict[str, Any]) -> list[dict[str, Any]]:
    from skipinject.store.tensorfile import plan_tensors

    return [{"name": p.name, "derive": p.derive} for p in plan_tensors(tensors, CONCATS) if p.derive is not None]


def test_cache_compact_says_why_it_skips_each_step_it_does_not_compact(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A linked step, one in a world-writable directory, one whose meta.json is a FIFO: each a
    ``skipped`` line with its reason; a damaged one found when read is ``failed``; exit 1; the good one
    compacted."""
    from skipinject.cache_tool import main

    dump = tmp_path / "dump"
    store = _layout_store(dump)
    for step in (1, 3, 4, 5):
        store.save(step, Payload(concats=CONCATS, tensors=padded_batch(), objects={}, rows=16))
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(store.step_dir(1), elsewhere)
    os.symlink(elsewhere, store.step_dir(2))
    store.step_dir(3).chmod(0o777)
    (store.step_dir(4) / "meta.json").unlink()
    os.mkfifo(store.step_dir(4) / "meta.json")
    next(store.step_dir(5).glob("objects-*")).write_bytes(b"[]")
    assert main(["compact", str(dump)]) == 1
    out = capsys.readouterr().out
    lines = {line.split()[1].rstrip(":").rsplit("/", 1)[-1]: line for line in out.splitlines()}
    assert sorted(lines) == ["1", "2", "3", "4", "5"], out
    assert lines["1"].startswith("compacted "), out
    assert all(lines[step].startswith("skipped ") for step in ("2", "3", "4")), out
    assert "symbolic link" in lines["2"] and "untrusted" in lines["3"] and "damaged" in lines["4"], out
    assert lines["5"].startswith("failed ") and "checksum mismatch" in lines["5"], out


def test_cache_compact_commits_only_over_the_step_it_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step is recorded anew between compact's load and its commit: the new recording is kept
    (no lost update), and the step is reported as failed with the reason."""
    from skipinject.cache_tool import main
    from skipinject.store.writer import StepWriter

    dump = tmp_path / "dump"
    store = _layout_store(dump)
    store.save(1, Payload(concats=CONCATS, tensors=padded_batch(), objects={"run": 1}, rows=16))
    commit = StepWriter.commit

    def racing_commit(self: StepWriter, meta: Any, **kwargs: Any) -> Any:
        if kwargs.get("over") is not None:  # compact's commit: another run records the step right now
            _layout_store(dump).save(1, Payload(concats=CONCATS, tensors=padded_batch(), objects={"run": 2}, rows=16))
        return commit(self, meta, **kwargs)

    monkeypatch.setattr(StepWriter, "commit", racing_commit)
    assert main(["compact", str(dump)]) == 1
    out = capsys.readouterr().out
    assert "failed" in out and "recorded anew" in out, out
    assert _load(store, 1).objects == {"run": 2}, "the newer recording is kept"


# ---------------------------------------------------------------- a local compressed file read in pieces


def _many_frames(tmp_path: Path) -> tuple[StepStore, dict[str, Any], Path]:
    tensors = {"noise": torch.randint(0, 1 << 30, (3, format.FRAME_BYTES // 8), dtype=torch.int64)}
    store = _store(tmp_path)
    store.save(1, Payload(concats=CONCATS, tensors=tensors, objects={}, rows=3))
    meta = json.loads((store.step_dir(1) / "meta.json").read_text())
    return store, tensors, store.step_dir(1) / meta["parts"][0]["files"]["tensors"]["name"]


def _changed_while_read(monkeypatch: pytest.MonkeyPatch, path: Path, change: Any) -> list[int]:
    """Read local files in pieces of 64 kB; ``change(path)`` once the tensor file's first piece has been read."""
    from skipinject.store import local

    monkeypatch.setattr(local, "STREAM_PIECE", 64 << 10)
    pieces = local._pieces
    read: list[int] = []

    def watched(fd: int, size: int) -> Any:
        ours = size == path.stat().st_size
        for number, piece in enumerate(pieces(fd, size)):
            if ours:
                read.append(len(piece))
            if ours and number == 0:
                change(path)
            yield piece

    monkeypatch.setattr(local, "_pieces", watched)
    return read


def test_a_local_compressed_file_is_read_in_pieces_and_loads_bit_for_bit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, tensors, path = _many_frames(tmp_path)
    read = _changed_while_read(monkeypatch, path, lambda _: None)
    assert_same(_load(store, 1).tensors, tensors)
    assert len(read) > 2 and max(read) == 64 << 10


def _flip_last_byte(path: Path) -> None:
    with open(path, "r+b") as handle:
        handle.seek(-1, os.SEEK_END)
        last = handle.read(1)[0]
        handle.seek(-1, os.SEEK_END)
        handle.write(bytes([last ^ 0xFF]))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (_flip_last_byte, "checksum mismatch"),
        (lambda path: os.truncate(path, path.stat().st_size - 1), "bytes read, meta.json records"),
        (lambda path: path.open("ab").write(b"more"), "bytes read, meta.json records"),
    ],
    ids=["byte flipped", "truncated", "grown"],
)
def test_a_local_compressed_file_changed_while_its_pieces_are_read_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: Any, message: str
) -> None:
    store, _, path = _many_frames(tmp_path)
    read = _changed_while_read(monkeypatch, path, change)
    with pytest.raises(CorruptCacheError, match=message):
        store.verified(1)
    assert len(read) > 1, "the change landed while the file was being read"
