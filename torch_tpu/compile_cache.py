"""The three-tier cache of compiled graphs.

1. in-process: key -> the loaded callable;
2. machine-local, shared between processes: a directory under /dev/shm (or
   the user cache directory where there is none), ``TORCH_TPU_LOCAL_CACHE_DIR``
   to move it;
3. persistent remote: ``TORCH_TPU_CACHE_DIR``, any mounted filesystem path,
   for reuse across hosts and restarts (off when unset).

A lookup walks the tiers in order; a hit in a lower tier is copied into the
tiers above it, a miss everywhere compiles and writes every tier. An entry is
one file: a magic line, a JSON header (key, torch and torch_tpu versions,
payload size and SHA-256) and the payload (Inductor's serialized artifact).
Files are written to a temporary name and renamed, so readers and concurrent
writers only ever see whole entries; an entry that is corrupt, truncated or
from other versions is recompiled and overwritten, never loaded.
``torch.tpu.compile_cache_stats()`` counts hits and misses per tier.

What an entry holds is Inductor's artifact: the traced, lowered and generated
graph, not the machine code of its C++ kernels, which Inductor builds with
``-march=native`` into its own cache (``TORCHINDUCTOR_CACHE_DIR``). A hit
skips Dynamo, AOTAutograd and Inductor's lowering; on a host whose Inductor
cache does not hold the kernels yet (another host, a fresh container) they
are built again - machine-specific binaries are not shared between hosts
(measured on a 4-layer MLP: 25.5 s cold, 19.1 s from a hit with a fresh
Inductor cache, 5.6 s with a warm one).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import logging
import operator
import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

MAGIC = b"torch_tpu compiled graph v1\n"
LOCAL_DIR_VARIABLE = "TORCH_TPU_LOCAL_CACHE_DIR"
REMOTE_DIR_VARIABLE = "TORCH_TPU_CACHE_DIR"
TIERS = ("memory", "local", "remote")


class CorruptEntry(ValueError):
    """A cache file that must not be loaded (damaged, or built by other versions)."""


@functools.cache  # reading package metadata is file I/O; every entry read and written asks
def versions() -> dict[str, str]:
    try:
        ours = importlib.metadata.version("torch_tpu")
    except importlib.metadata.PackageNotFoundError:
        ours = "unknown"
    return {"torch": torch.__version__, "torch_tpu": ours}


def default_local_dir() -> Path:
    if LOCAL_DIR_VARIABLE in os.environ:
        return Path(os.environ[LOCAL_DIR_VARIABLE])
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm / f"torch_tpu_compile_cache_{os.getuid()}"
    return Path.home() / ".cache" / "torch_tpu" / "compile"


def remote_dir() -> Path | None:
    value = os.environ.get(REMOTE_DIR_VARIABLE, "").strip()
    return Path(value) if value else None


def encode_entry(key: str, payload: bytes) -> bytes:
    header = dict(versions(), key=key, size=len(payload), sha256=hashlib.sha256(payload).hexdigest())
    return MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n" + payload


def decode_entry(data: bytes, key: str) -> bytes:
    """The payload of an entry file for `key`; CorruptEntry when it must not be loaded."""
    if not data.startswith(MAGIC):
        raise CorruptEntry("not a torch_tpu cache entry (bad magic)")
    end = data.find(b"\n", len(MAGIC))
    if end < 0:
        raise CorruptEntry("truncated header")
    try:
        header = json.loads(data[len(MAGIC):end])
    except ValueError as error:
        raise CorruptEntry(f"unreadable header: {error}") from None
    payload = data[end + 1:]
    for name, value in versions().items():
        if header.get(name) != value:
            raise CorruptEntry(f"built by {name} {header.get(name)}, this is {value}")
    if header.get("key") != key:
        raise CorruptEntry(f"entry for key {header.get('key')!r}, asked for {key!r}")
    if header.get("size") != len(payload) or header.get("sha256") != hashlib.sha256(payload).hexdigest():
        raise CorruptEntry(f"payload checksum mismatch ({len(payload)} of {header.get('size')} bytes)")
    return payload


def write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp's 0600 would keep other users' processes sharing the tier from reading it.
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@dataclasses.dataclass
class TierStats:
    hits: int = 0
    misses: int = 0


class CompileCache:
    """Compiled graphs by key, over the three tiers (see the module docstring).

    ``compile`` returns an artifact with ``save(path=...)``; ``load`` turns a
    saved payload file back into a callable (Inductor's CompiledArtifact API).
    """

    def __init__(
        self,
        local: Path | None,
        remote: Path | None,
        load: Callable[[Path], Callable[..., Any]] | None = None,
    ) -> None:
        self.local = local
        self.remote = remote
        self._load = load or _load_artifact
        self._memory: dict[str, Callable[..., Any]] = {}
        self._lock = threading.Lock()
        self.stats = {tier: TierStats() for tier in TIERS}

    def _dirs(self) -> list[tuple[str, Path]]:
        return [(tier, d) for tier, d in (("local", self.local), ("remote", self.remote)) if d is not None]

    def get(self, key: str, compile: Callable[[], Any], persist: bool = True) -> Callable[..., Any]:
        """The compiled callable for `key`, compiling it (once) on a miss everywhere.
        ``persist=False``: the in-process tier only (neither read from nor written to files)."""
        with self._lock:
            if key in self._memory:
                self.stats["memory"].hits += 1
                return self._memory[key]
            self.stats["memory"].misses += 1
            payload, missed = self._read_files(key) if persist else (None, [])
            fn = None
            if payload is not None:
                found = next(tier for tier, _ in self._dirs() if tier not in missed)
                try:
                    fn = self._load_payload(payload)
                    self.stats[found].hits += 1
                except Exception as error:  # a payload that passed the checksum yet does not load
                    logger.warning("compile cache: entry %s does not load (%s): recompiling", key[:16], error)
                    self.stats[found].misses += 1
                    missed = [tier for tier, _ in self._dirs()]
            if fn is None:
                artifact = compile()
                payload = _artifact_bytes(artifact) if persist else None
                fn = artifact
            for tier, d in self._dirs():
                if tier in missed and payload is not None:
                    try:
                        write_atomic(d / f"{key}.bin", encode_entry(key, payload))
                    except OSError as error:
                        logger.warning("compile cache: cannot write the %s tier at %s: %s", tier, d, error)
            self._memory[key] = fn
            return fn

    def _read_files(self, key: str) -> tuple[bytes | None, list[str]]:
        """The first good payload down the file tiers, and the tiers that missed before it
        (counted; the tier that has it counts a hit once its payload loads)."""
        missed: list[str] = []
        for tier, d in self._dirs():
            path = d / f"{key}.bin"
            try:
                data = path.read_bytes()
                payload = decode_entry(data, key)
            except FileNotFoundError:
                pass
            except (OSError, CorruptEntry) as error:
                logger.warning("compile cache: %s entry %s rejected (%s): recompiling", tier, path, error)
            else:
                return payload, missed
            self.stats[tier].misses += 1
            missed.append(tier)
        return None, missed

    def _load_payload(self, payload: bytes) -> Callable[..., Any]:
        with tempfile.TemporaryDirectory(prefix="torch_tpu_cc_") as tmp:
            path = Path(tmp) / "artifact.bin"
            path.write_bytes(payload)
            return self._load(path)

    def clear_memory(self) -> None:
        """Forgets the in-process tier (the file tiers stay)."""
        with self._lock:
            self._memory.clear()

    def reset_stats(self) -> None:
        with self._lock:
            self.stats = {tier: TierStats() for tier in TIERS}


def _artifact_bytes(artifact: Any) -> bytes | None:
    """The serialized artifact, or None when Inductor cannot save it (the
    graph then stays in the in-process tier only)."""
    with tempfile.TemporaryDirectory(prefix="torch_tpu_cc_") as tmp:
        path = Path(tmp) / "artifact.bin"
        try:
            artifact.save(path=str(path), format="binary")
        except (RuntimeError, AssertionError) as error:
            logger.info("compile cache: artifact not saveable (%s): kept in process only", error)
            return None
        return path.read_bytes()


def _load_artifact(path: Path) -> Callable[..., Any]:
    return torch._inductor.CompiledArtifact.load(path=str(path), format="binary")


_cache: CompileCache | None = None
_cache_lock = threading.Lock()


def compile_cache() -> CompileCache:
    """The process's cache, its directories read from the environment on first use."""
    global _cache
    with _cache_lock:
        if _cache is None:
            _cache = CompileCache(default_local_dir(), remote_dir())
        return _cache


def reset_compile_cache() -> None:
    """Drops the process's cache object: the next use re-reads the environment."""
    global _cache
    with _cache_lock:
        _cache = None


def compile_cache_stats() -> dict[str, dict[str, int]]:
    """Hits and misses per tier since the process started (or the last reset)."""
    return {tier: dataclasses.asdict(s) for tier, s in compile_cache().stats.items()}


def tensor_constants(gm: torch.fx.GraphModule) -> dict[str, torch.Tensor]:
    """The tensors the graph's get_attr nodes read (constants: ``torch.tensor(...)`` in the
    traced code), by target."""
    out = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = operator.attrgetter(node.target)(gm)
            if isinstance(value, torch.Tensor):
                out[node.target] = value
    return out


def graph_key(gm: torch.fx.GraphModule, example_inputs: list[Any], salt: str = "") -> str:
    """A key over the graph's code and constants, its inputs' shapes, strides
    and dtypes, scalar arguments, the versions and Inductor's configuration."""
    h = hashlib.sha256()
    h.update(gm.code.encode())
    for target, value in tensor_constants(gm).items():
        # Its geometry too: [1, 2, 3, 4] and [[1, 2, 3, 4]] have the same bytes.
        h.update(repr((target, tuple(value.shape), value.stride(), value.dtype)).encode())
        h.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    for t in example_inputs:
        if isinstance(t, torch.Tensor):
            h.update(repr((tuple(t.shape), t.stride(), t.dtype, t.device.type)).encode())
        else:
            h.update(repr(t).encode())
    h.update(json.dumps(versions(), sort_keys=True).encode())
    h.update(repr(sorted(torch._inductor.config.save_config_portable().items())).encode())
    h.update(salt.encode())
    return h.hexdigest()
