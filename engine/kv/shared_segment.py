"""A named POSIX shared-memory segment holding a KV buffer that other processes on this host map
by name: a decode node's for the shm transport, or every rank's of a tensor-parallel engine on
the CPU (engine/kv/shared_kv_cache.py).

The segment is `pdserve-kv-<id>` under /dev/shm (the id is the node id, or one the engine draws): a one-page header (magic, owner pid,
payload size) and the payload, which starts page-aligned. The owner creates it and unlinks it
on close or at interpreter exit. A crashed owner leaves it behind; the next owner of that name
finds it, sees that the recorded pid is no longer running, and replaces it. A segment whose
owner is alive is never touched: two live nodes on one host must not share a node id.
Mappings are pre-faulted (MAP_POPULATE) so the first copy does not pay a page fault per page.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
import weakref
from pathlib import Path

import torch

SHM_DIR = Path("/dev/shm")
SEGMENT_PREFIX = "pdserve-kv-"
HEADER_BYTES = 4096
MAGIC = b"PDSKVSEG"
HEADER_FORMAT = "<8sqq"  # magic, owner pid, payload bytes
NODE_ID_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def segment_name(node_id: str) -> str:
    if not NODE_ID_PATTERN.fullmatch(node_id):
        raise ValueError(f"node id {node_id!r} must be 1-64 of A-Z a-z 0-9 _ . -")
    return SEGMENT_PREFIX + node_id


def _shm_dir() -> Path:
    if not SHM_DIR.is_dir():
        raise RuntimeError(f"the shm KV transport needs POSIX shared memory at {SHM_DIR} (Linux)")
    return SHM_DIR


def _unlink_quietly(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def _process_is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _read_header(path: Path) -> tuple[int, int] | None:
    """(owner pid, payload bytes), or None when the file is not a complete segment header."""
    try:
        with open(path, "rb") as segment:
            raw = segment.read(struct.calcsize(HEADER_FORMAT))
    except OSError:
        return None
    if len(raw) != struct.calcsize(HEADER_FORMAT):
        return None
    magic, pid, payload_bytes = struct.unpack(HEADER_FORMAT, raw)
    return (pid, payload_bytes) if magic == MAGIC else None


class SharedSegment:
    """A mapped segment; `payload` is a uint8 tensor over its bytes after the header."""

    def __init__(self, path: Path, mapping: mmap.mmap, payload_bytes: int, owner: bool) -> None:
        self.path = path
        self._mapping = mapping
        self.payload: torch.Tensor | None = torch.frombuffer(
            mapping, dtype=torch.uint8, count=payload_bytes, offset=HEADER_BYTES
        )
        self._unlink_at_exit = weakref.finalize(self, _unlink_quietly, path) if owner else None

    @classmethod
    def create(cls, node_id: str, payload_bytes: int) -> SharedSegment:
        path = _shm_dir() / segment_name(node_id)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except FileExistsError:
            cls._remove_stale(path)
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            total = HEADER_BYTES + payload_bytes
            try:
                os.posix_fallocate(fd, 0, total)
            except OSError as error:
                raise RuntimeError(
                    f"cannot reserve {total:,} bytes of shared memory for {path.name}: {error}"
                ) from None
            mapping = mmap.mmap(fd, total, flags=mmap.MAP_SHARED | _populate_flag())
        except BaseException:
            os.close(fd)
            _unlink_quietly(path)
            raise
        os.close(fd)
        mapping[: struct.calcsize(HEADER_FORMAT)] = struct.pack(
            HEADER_FORMAT, MAGIC, os.getpid(), payload_bytes
        )
        return cls(path, mapping, payload_bytes, owner=True)

    @classmethod
    def attach(cls, name: str, payload_bytes: int) -> SharedSegment:
        if not name.startswith(SEGMENT_PREFIX) or not NODE_ID_PATTERN.fullmatch(
            name[len(SEGMENT_PREFIX):]
        ):
            raise ValueError(f"{name!r} is not a KV segment name")
        path = _shm_dir() / name
        header = _read_header(path)
        if header is None:
            raise RuntimeError(f"shared-memory KV segment {name} does not exist or is not one")
        if header[1] != payload_bytes:
            raise RuntimeError(
                f"shared-memory KV segment {name} holds {header[1]:,} bytes; the descriptor "
                f"says {payload_bytes:,}"
            )
        fd = os.open(path, os.O_RDWR)
        try:
            mapping = mmap.mmap(
                fd, HEADER_BYTES + payload_bytes, flags=mmap.MAP_SHARED | _populate_flag()
            )
        finally:
            os.close(fd)
        return cls(path, mapping, payload_bytes, owner=False)

    @staticmethod
    def remove_abandoned(id_prefix: str) -> None:
        """Unlinks every segment whose id starts with `id_prefix` and whose owner is no longer
        running: what killed owners of drawn ids left behind (a new owner never meets them)."""
        for path in _shm_dir().glob(SEGMENT_PREFIX + id_prefix + "*"):
            header = _read_header(path)
            if header is not None and not _process_is_running(header[0]):
                _unlink_quietly(path)

    @staticmethod
    def _remove_stale(path: Path) -> None:
        header = _read_header(path)
        if header is not None and header[0] != os.getpid() and _process_is_running(header[0]):
            raise RuntimeError(
                f"shared-memory KV segment {path.name} belongs to running process {header[0]}; "
                "node ids must be unique on a host"
            )
        if header is not None and header[0] == os.getpid():
            raise RuntimeError(f"this process already owns shared-memory KV segment {path.name}")
        _unlink_quietly(path)

    def close(self) -> None:
        """Unlinks the segment if this side owns it; unmaps it unless tensors still view it
        (then the mapping goes with the process)."""
        self.payload = None
        if self._unlink_at_exit is not None:
            self._unlink_at_exit()
        try:
            self._mapping.close()
        except BufferError:
            pass


def _populate_flag() -> int:
    return getattr(mmap, "MAP_POPULATE", 0)
