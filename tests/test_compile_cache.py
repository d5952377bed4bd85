"""The three-tier compile cache: entries checked before loading, tiers walked
in order and filled on the way back, and - with real compiles in separate
processes - a second process compiles nothing, a corrupt entry is recompiled,
concurrent writers leave whole entries."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torch_tpu import compile_cache as cc


class FakeArtifact:
    """Stands in for Inductor's CompiledArtifact: callable, saves its bytes."""

    def __init__(self, payload: bytes) -> None:
        self.payload = payload

    def __call__(self) -> bytes:
        return self.payload

    def save(self, *, path: str, format: str) -> None:
        Path(path).write_bytes(self.payload)


def load_fake(path: Path) -> FakeArtifact:
    return FakeArtifact(path.read_bytes())


def counting_compile(payload: bytes, counter: list):
    def compile():
        counter.append(payload)
        return FakeArtifact(payload)
    return compile


def test_entries_round_trip_and_damage_is_refused():
    entry = cc.encode_entry("k1", b"payload bytes")
    assert cc.decode_entry(entry, "k1") == b"payload bytes"
    flipped = bytearray(entry)
    flipped[-3] ^= 0x01
    with pytest.raises(cc.CorruptEntry, match="checksum"):
        cc.decode_entry(bytes(flipped), "k1")
    with pytest.raises(cc.CorruptEntry, match="checksum"):
        cc.decode_entry(entry[:-4], "k1")
    with pytest.raises(cc.CorruptEntry, match="magic"):
        cc.decode_entry(b"garbage" + entry, "k1")
    with pytest.raises(cc.CorruptEntry, match="asked for 'k2'"):
        cc.decode_entry(entry, "k2")
    stale = entry.replace(json.dumps(cc.versions()["torch"]).encode(), b'"1.0.0"')
    with pytest.raises(cc.CorruptEntry, match="built by torch 1.0.0"):
        cc.decode_entry(stale, "k1")


def test_tiers_are_walked_in_order_and_filled_on_the_way_back(tmp_path):
    compiled: list = []
    local, remote = tmp_path / "local", tmp_path / "remote"
    first = cc.CompileCache(local, remote, load=load_fake)
    assert first.get("k", counting_compile(b"A", compiled))() == b"A"
    assert first.get("k", counting_compile(b"B", compiled))() == b"A"  # in-process hit
    assert compiled == [b"A"]
    assert {t: (s.hits, s.misses) for t, s in first.stats.items()} == {
        "memory": (1, 1), "local": (0, 1), "remote": (0, 1)}
    assert (local / "k.bin").exists() and (remote / "k.bin").exists()

    # Another process on this machine: the local tier answers.
    second = cc.CompileCache(local, remote, load=load_fake)
    assert second.get("k", counting_compile(b"B", compiled))() == b"A"
    assert compiled == [b"A"] and second.stats["local"].hits == 1 and second.stats["remote"].misses == 0

    # Another host (empty local tier): the remote answers and the local is filled.
    other_local = tmp_path / "other"
    third = cc.CompileCache(other_local, remote, load=load_fake)
    assert third.get("k", counting_compile(b"B", compiled))() == b"A"
    assert compiled == [b"A"] and third.stats["remote"].hits == 1
    assert cc.decode_entry((other_local / "k.bin").read_bytes(), "k") == b"A"


def test_a_corrupt_entry_falls_through_and_is_rewritten(tmp_path, caplog):
    compiled: list = []
    local = tmp_path / "local"
    cc.CompileCache(local, None, load=load_fake).get("k", counting_compile(b"A", compiled))
    (local / "k.bin").write_bytes((local / "k.bin").read_bytes()[:-1])  # truncated by a crash, say
    again = cc.CompileCache(local, None, load=load_fake)
    assert again.get("k", counting_compile(b"A2", compiled))() == b"A2"
    assert compiled == [b"A", b"A2"]
    assert (again.stats["local"].hits, again.stats["local"].misses) == (0, 1)  # compiled: not a hit


def test_entries_are_readable_by_other_users_sharing_the_tier(tmp_path):
    cc.CompileCache(tmp_path, None, load=load_fake).get("k", counting_compile(b"A", []))
    assert (tmp_path / "k.bin").stat().st_mode & 0o777 == 0o644
    assert "rejected" in caplog.text
    assert cc.decode_entry((local / "k.bin").read_bytes(), "k") == b"A2"


def test_an_entry_that_passes_the_checksum_but_does_not_load_is_recompiled(tmp_path):
    def broken_load(path):
        raise RuntimeError("cannot load")

    compiled: list = []
    cc.CompileCache(tmp_path, None, load=load_fake).get("k", counting_compile(b"A", compiled))
    again = cc.CompileCache(tmp_path, None, load=broken_load)
    assert again.get("k", counting_compile(b"A2", compiled))() == b"A2"
    assert compiled == [b"A", b"A2"]
    assert (again.stats["local"].hits, again.stats["local"].misses) == (0, 1)  # compiled: not a hit


def test_entries_are_readable_by_other_users_sharing_the_tier(tmp_path):
    cc.CompileCache(tmp_path, None, load=load_fake).get("k", counting_compile(b"A", []))
    assert (tmp_path / "k.bin").stat().st_mode & 0o777 == 0o644


def test_an_unwritable_tier_does_not_fail_the_compile(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    cache = cc.CompileCache(blocker / "sub", None, load=load_fake)
    assert cache.get("k", counting_compile(b"A", []))() == b"A"


WORKER = r"""
import json, sys
import torch, torch_tpu
from torch_tpu.compile_cache import compile_cache_stats
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.LayerNorm(48), torch.nn.GELU(),
                            torch.nn.Linear(48, 3)).to("tpu")
x = torch.randn(16, 24, device="tpu")
out = torch.compile(model, backend="tpu")(x)
out.sum().backward()
ref = model(x)
print(json.dumps({"stats": compile_cache_stats(), "error": (out - ref).abs().max().item()}))
"""


def run_workers(n: int, local: Path, remote: Path | None = None) -> list[dict]:
    env = dict(os.environ, TORCH_TPU_LOCAL_CACHE_DIR=str(local))
    env.pop(cc.REMOTE_DIR_VARIABLE, None)
    if remote is not None:
        env[cc.REMOTE_DIR_VARIABLE] = str(remote)
    procs = [subprocess.Popen([sys.executable, "-c", WORKER], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(n)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def test_a_second_process_compiles_nothing_and_a_corrupt_entry_is_recompiled(tmp_path):
    local, remote = tmp_path / "local", tmp_path / "remote"
    (first,) = run_workers(1, local, remote)
    graphs = first["stats"]["local"]["misses"]
    assert graphs >= 2 and first["stats"]["remote"]["misses"] == graphs  # forward and backward compiled
    assert first["error"] < 1e-5

    (second,) = run_workers(1, local, remote)
    assert second["stats"]["local"] == {"hits": graphs, "misses": 0}  # nothing compiled
    assert second["stats"]["remote"] == {"hits": 0, "misses": 0}
    assert second["error"] < 1e-5

    (other_host,) = run_workers(1, tmp_path / "other_local", remote)
    assert other_host["stats"]["remote"] == {"hits": graphs, "misses": 0}

    for entry in local.glob("*.bin"):
        data = bytearray(entry.read_bytes())
        data[len(data) // 2] ^= 0xFF
        entry.write_bytes(bytes(data))
    (after,) = run_workers(1, local, None)
    assert after["stats"]["local"] == {"hits": 0, "misses": graphs}  # rejected, recompiled
    assert after["error"] < 1e-5
    for entry in local.glob("*.bin"):
        cc.decode_entry(entry.read_bytes(), entry.stem)  # rewritten whole


def test_concurrent_writers_leave_whole_entries(tmp_path):
    local = tmp_path / "local"
    results = run_workers(2, local)
    assert all(r["error"] < 1e-5 for r in results)
    entries = list(local.glob("*.bin"))
    assert entries and not list(local.glob(".*.tmp"))
    for entry in entries:
        cc.decode_entry(entry.read_bytes(), entry.stem)


def test_a_persist_false_entry_stays_in_process(tmp_path):
    local = tmp_path / "local"
    cache = cc.CompileCache(local, None, load=load_fake)
    compiles: list = []
    assert cache.get("k", counting_compile(b"A", compiles), persist=False)() == b"A"
    assert cache.get("k", counting_compile(b"B", compiles), persist=False)() == b"A"  # the in-process tier
    assert compiles == [b"A"] and not list(local.glob("*.bin"))
    assert cache.stats["local"].misses == 0  # the file tier is not even read


CONSTANTS_WORKER = r"""
import json
import torch, torch_tpu
from torch_tpu.compile_cache import compile_cache_stats

def f(x):
    return x * torch.tensor(2.0) + torch.tensor([[1.0, 2.0, 3.0, 4.0]]).to(x.device)

def g(x):  # the same constant bytes in another shape
    return x * torch.tensor(2.0) + torch.tensor([1.0, 2.0, 3.0, 4.0]).to(x.device)

x = torch.randn(4, device="tpu")
out = [torch.compile(fn, backend="tpu")(x) for fn in (g, f)]
ok = [bool(torch.equal(o.cpu(), fn(x).cpu())) and o.shape == fn(x).shape for o, fn in zip(out, (g, f))]
print(json.dumps({"ok": ok, "shapes": [list(o.shape) for o in out], "stats": compile_cache_stats()}))
"""


def test_graphs_with_tensor_constants_compile_in_every_process_and_keep_their_shapes(tmp_path):
    """A constant's geometry is part of the key ([1, 2, 3, 4] and [[1, 2, 3, 4]] hold the same
    bytes: the second graph got the first's code and returned shape (4,)). Such graphs stay in
    the in-process tier: a saved artifact loses its constants, and a second process loading it
    from the local tier crashed in Inductor's wrapper."""
    env = dict(os.environ, TORCH_TPU_LOCAL_CACHE_DIR=str(tmp_path / "local"))
    env.pop(cc.REMOTE_DIR_VARIABLE, None)
    for _ in range(2):
        run = subprocess.run([sys.executable, "-c", CONSTANTS_WORKER], env=env, capture_output=True, text=True,
                             timeout=240)
        assert run.returncode == 0, run.stderr[-3000:]
        result = json.loads(run.stdout.strip().splitlines()[-1])
        assert result["ok"] == [True, True] and result["shapes"] == [[4], [1, 4]]
