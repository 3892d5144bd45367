"""Checkpoints that never run code when read, and manifests that find damage: the allow-listed
unpickler of dist-checkpoint metadata, ``common.pt`` with ``weights_only=True``, the manifest's
size and checksum checks, the fallback to the newest intact checkpoint and retention beside it."""

from __future__ import annotations

import ast
import inspect
import os
import pickle
import textwrap
from pathlib import Path

import pytest
import torch

import megarl.checkpoint.manifest as manifest
from megarl.checkpoint.safe_load import load_common, load_failure
from megarl.checkpoint.safe_metadata import read_dist_metadata, safe_filesystem_reader
from megarl.checkpoint.store import LATEST_FILE, resolve_checkpoint, write_latest
from megarl.errors import CheckpointError
from megarl.run import retention, verification

pytestmark = pytest.mark.unit


class Payload:
    """Unpickling this runs ``os.system``: it writes ``marker`` (the side effect tests look for)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def tiny_dist_checkpoint(path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    state = {"embedding.word_embeddings.weight": torch.arange(8.0).reshape(4, 2)}
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    (path / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')


def test_real_metadata_reads_and_a_pickle_payload_never_runs(tmp_path):
    mcore = tmp_path / "mcore"
    tiny_dist_checkpoint(mcore)
    md = read_dist_metadata(mcore)
    assert list(md.state_dict_metadata) == ["embedding.word_embeddings.weight"]
    marker = tmp_path / "payload-ran"
    (mcore / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(CheckpointError, match=r"names posix\.system.*refuses to read it"):
        read_dist_metadata(mcore)
    assert not marker.exists()  # refused before anything was called


def test_metadata_declaring_pickled_objects_is_refused(tmp_path):
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    mcore = tmp_path / "mcore"
    tiny_dist_checkpoint(mcore)
    md = read_dist_metadata(mcore)
    # Transformer Engine's FP8 metadata, which megarl never loads, is the one object allowed
    md.state_dict_metadata["decoder.layers.mlp.linear_fc1._extra_state/shard_0.0_1.1"] = (
        BytesStorageMetadata()
    )
    (mcore / ".metadata").write_bytes(pickle.dumps(md))
    assert "decoder.layers.mlp.linear_fc1._extra_state/shard_0.0_1.1" in (
        read_dist_metadata(mcore).state_dict_metadata
    )
    md.state_dict_metadata["embedding.word_embeddings.weight"] = BytesStorageMetadata()
    (mcore / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointError, match=r"declares pickled objects \(embedding"):
        read_dist_metadata(mcore)


def test_garbled_or_truncated_metadata_names_the_file(tmp_path):
    mcore = tmp_path / "mcore"
    tiny_dist_checkpoint(mcore)
    data = (mcore / ".metadata").read_bytes()
    (mcore / ".metadata").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"cannot read .*\.metadata.*damaged"):
        read_dist_metadata(mcore)


def test_a_shard_payload_or_a_refusal_inside_torchs_load_is_one_checkpoint_error(tmp_path):
    """What torch's distributed load raises for a bad shard is a CheckpointException (not an
    Exception) holding each rank's error and traceback: :func:`load_failure` turns it into one
    line, keeping megarl's own refusal as it is."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    mcore = tmp_path / "mcore"
    tiny_dist_checkpoint(mcore)
    [shard] = mcore.glob("*.distcp")
    marker = tmp_path / "payload-ran"
    payload = pickle.dumps(Payload(marker))
    shard.write_bytes(payload + bytes(max(0, shard.stat().st_size - len(payload))))
    state = {"embedding.word_embeddings.weight": torch.zeros(4, 2)}
    with pytest.raises(CheckpointException) as raised:
        dcp.load(state, storage_reader=safe_filesystem_reader(mcore), no_dist=True)
    assert not isinstance(raised.value, Exception) and "Traceback" in str(raised.value)
    error = load_failure(mcore, raised.value)
    assert isinstance(error, CheckpointError) and not marker.exists()
    assert f"a shard of {mcore} holds more than plain data" in str(error)
    assert "\n" not in str(error)
    own = CheckpointError("megarl's own refusal")
    assert load_failure(mcore, CheckpointException("x", {1: (own, None)})) is own
    other = load_failure(mcore, RuntimeError("missing\nsecond line"))
    assert str(other).startswith(f"cannot load checkpoint {mcore}: RuntimeError: missing. The")
    assert "second line" not in str(other)


def test_common_state_loads_plain_data_only(tmp_path):
    torch.save(
        {"optimizer": {"param_groups": [{"lr": 1e-3, "betas": (0.9, 0.99)}]}},
        tmp_path / "common.pt",
    )
    assert load_common(tmp_path)["optimizer"]["param_groups"][0]["lr"] == 1e-3
    marker = tmp_path / "payload-ran"
    with open(tmp_path / "common.pt", "wb") as f:
        pickle.dump({"optimizer": Payload(marker)}, f)
    with pytest.raises(CheckpointError, match="holds more than plain data"):
        load_common(tmp_path)
    assert not marker.exists()


def test_megatron_still_builds_its_reader_where_the_safe_strategy_replaces_it():
    """megatron's torch_dist load strategy gets its FileSystemReader from the module function
    that megarl.checkpoint.safe_load swaps for the duration of a load; an upgrade that builds it
    elsewhere would read .metadata with plain pickle again."""
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch

    for method in ("load", "load_tensors_metadata", "load_sharded_metadata"):
        source = inspect.getsource(getattr(mcore_torch.TorchDistLoadShardedStrategy, method))
        calls = {
            n.func.id
            for n in ast.walk(ast.parse(textwrap.dedent(source)))
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
        }
        assert "_get_filesystem_reader" in calls and "FileSystemReader" not in calls, method


# -- manifests ---------------------------------------------------------------------------------


def checkpoint_folder(path: Path, payload: bytes = b"x" * 5000) -> Path:
    """A role folder as a save leaves it: data files, metadata, and their manifest."""
    (path / "mcore").mkdir(parents=True)
    (path / "mcore" / "__0_0.distcp").write_bytes(payload)
    (path / "mcore" / "__1_0.distcp").write_bytes(payload[::-1])
    (path / "megarl_checkpoint.json").write_text('{"role": "actor"}')
    manifest.write(path, [manifest.record(path, n) for n in manifest.files_under(path)])
    return path


def test_manifest_finds_a_changed_byte_a_truncation_and_a_missing_file(tmp_path):
    ckpt = checkpoint_folder(tmp_path / "ckpt")
    assert manifest.verify(ckpt) == []
    data = ckpt / "mcore" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[1234] ^= 0x01
    data.write_bytes(bytes(raw))
    assert manifest.verify(ckpt, full=False) == []  # same size: only the checksum sees it
    assert manifest.verify(ckpt) == [
        "mcore/__0_0.distcp: its bytes differ from what was written (checksum mismatch)"
    ]
    other = ckpt / "mcore" / "__1_0.distcp"
    other.write_bytes(other.read_bytes()[:100])
    (ckpt / "megarl_checkpoint.json").unlink()
    problems = manifest.verify(ckpt, full=False)
    assert "mcore/__1_0.distcp is 100 bytes, its manifest records 5,000 (truncated)" in problems
    assert "megarl_checkpoint.json is missing" in problems


def test_files_are_hashed_by_the_rank_that_wrote_them():
    assert manifest.writer_rank("mcore/__3_1.distcp", world=4) == 3
    assert manifest.writer_rank("mcore/.metadata", world=4) == 0
    assert manifest.writer_rank("mcore/__7_0.distcp", world=4) == 0  # no such rank: rank 0


def training_step(root: Path, step: int) -> Path:
    folder = root / f"step_{step:08d}"
    checkpoint_folder(folder / "actor", payload=bytes([step]) * 5000)
    (folder / "trainer").mkdir()
    (folder / "trainer" / "trainer_state.pt").write_bytes(b"state")
    manifest.write(folder, [manifest.record(folder, "trainer/trainer_state.pt")])
    return folder


def test_resume_falls_back_to_the_newest_intact_checkpoint_and_keeps_the_damaged_one(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        training_step(root, step)
    write_latest(root, "step_00000006")
    target = root / "step_00000006" / "actor" / "mcore" / "__0_0.distcp"
    raw = bytearray(target.read_bytes())
    raw[100:4196] = os.urandom(4096)  # 4 KiB of random bytes inside the file
    target.write_bytes(bytes(raw))
    (root / "step_00000004" / "trainer" / "trainer_state.pt").write_bytes(b"st")  # truncated
    assert verification.newest_intact(root, rank=0) == root / "step_00000002"
    assert (root / LATEST_FILE).read_text().strip() == "step_00000002"
    names = sorted(p.name for p in root.iterdir())
    assert names == ["latest", "step_00000002", "step_00000004.damaged", "step_00000006.damaged"]
    # retention counts intact checkpoints only: a newer damaged one never pushes out step 2
    training_step(root, 7)
    write_latest(root, "step_00000007")
    assert retention.prune(root, keep_last=2) == []
    assert retention.prune(root, keep_last=1) == [root / "step_00000002"]
    assert (root / "step_00000006.damaged").is_dir()


def test_latest_intact_is_the_same_notion_without_changing_anything(tmp_path):
    """What the elastic supervisor and the pre-launch check use: one process, nothing renamed;
    sizes by default (cheap), checksums on request, as the ranks' resume checks them."""
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        training_step(root, step)
    write_latest(root, "step_00000006")
    (root / "step_00000006" / "trainer" / "trainer_state.pt").write_bytes(b"st")  # truncated
    target = root / "step_00000004" / "actor" / "mcore" / "__0_0.distcp"
    raw = bytearray(target.read_bytes())
    raw[100:4196] = os.urandom(4096)  # same size, other bytes: only a checksum sees it
    target.write_bytes(bytes(raw))
    before = sorted(p.name for p in root.iterdir())
    assert verification.latest_intact(root) == root / "step_00000004"
    assert verification.latest_intact(root, checksums=True) == root / "step_00000002"
    assert sorted(p.name for p in root.iterdir()) == before
    assert (root / LATEST_FILE).read_text().strip() == "step_00000006"
    assert verification.newest_intact(root, rank=0) == root / "step_00000002"  # the ranks' form
    assert verification.latest_intact(root) == root / "step_00000002"


def test_no_intact_checkpoint_is_an_error_naming_the_way_on(tmp_path):
    root = tmp_path / "checkpoints"
    training_step(root, 2)
    write_latest(root, "step_00000002")
    (root / "step_00000002" / "actor" / "mcore" / "__1_0.distcp").unlink()
    with pytest.raises(
        CheckpointError,
        match=r"no intact checkpoint.*__1_0.distcp is missing.*trainer.overwrite=true",
    ):
        verification.newest_intact(root, rank=0)


def test_resolve_takes_a_run_root_a_step_folder_or_a_role_folder(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (2, 4):
        training_step(root, step)
        checkpoint_folder(root / f"step_{step:08d}" / "critic")
    write_latest(root, "step_00000004")
    actor = root / "step_00000004" / "actor"
    assert resolve_checkpoint(root) == actor
    assert resolve_checkpoint(root / "step_00000004") == actor
    assert resolve_checkpoint(actor) == actor
    assert (
        resolve_checkpoint(root / "step_00000002" / "critic") == root / "step_00000002" / "critic"
    )


HASHED_SAVE = """
import os, sys, torch, torch.distributed as dist
from pathlib import Path
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("gloo", rank=0, world_size=1)
from megarl.platform import adapt_megatron_for_cpu
adapt_megatron_for_cpu()
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor
import megarl.checkpoint.manifest as manifest
from megarl.checkpoint.write_hashing import SIDECAR, hashed_writes, take_sidecar
out = Path(sys.argv[1])
out.mkdir()
state = {f"w{i}": ShardedTensor.from_rank_offsets(f"w{i}", torch.randn(300, 70)) for i in range(4)}
with hashed_writes():
    dist_checkpointing.save(state, str(out))
data = sorted(out.glob("*.distcp"))
print("data files", len(data), "sidecars", len(list(out.glob("*" + SIDECAR))))
for path in data:
    assert take_sidecar(path) == manifest.checksum(path), path
print("digests equal the files' checksums; sidecars left", len(list(out.glob("*" + SIDECAR))))
"""


def test_data_files_are_hashed_as_megatron_writes_them(tmp_path):
    """The digests a save leaves beside its data files are those of the bytes on disk: megarl
    need not read a checkpoint back to write its manifest."""
    import subprocess
    import sys

    from megarl.ports import free_port

    proc = subprocess.run(
        [sys.executable, "-c", HASHED_SAVE, str(tmp_path / "mcore"), str(free_port())],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2])),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = int(proc.stdout.split("data files ")[1].split()[0])
    assert files >= 1 and f"sidecars {files}" in proc.stdout, proc.stdout
    assert "digests equal the files' checksums; sidecars left 0" in proc.stdout
