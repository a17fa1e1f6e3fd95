"""Park memory between the phases of a colocated trainer and bring it back at the same addresses.

Allocations made in a region carry its tag and the tag's backup policy:

    "none"          contents undefined after resume (gradients)
    "cpu"           copied to pinned host memory at pause, restored bitwise at resume (optimizer state);
                    the pinned copy is kept across cycles
    "restore_from"  restored at resume from host memory registered with register_backup() (parameters, from
                    the trainer's one pinned copy of the weights); nothing is copied at pause

pause(tag) / pause() release the physical memory of one tag / every active tag; resume(tag) / resume()
map fresh memory at the same addresses and restore what the policy says.

Two savers share this interface:

* ``preloaded()``: the saver of the LD_PRELOAD shim, for a process whose CUDA allocations (PyTorch's caching
  allocator) should go through it. Start the process with ``LD_PRELOAD=$(python -c "from deltatrain import
  memsaver; print(memsaver.preload_library())")``; inside ``with saver.region(tag, backup):`` every cudaMalloc
  of the calling thread comes from the saver (with torch, from a MemPool of that region, so that the caching
  allocator never serves one region's tensors from another's memory). The shim is driven through ctypes, so
  this path needs neither the compiled module nor anything else of deltatrain.
* ``Saver(backend)``: a saver of this process's own, over host pages ("host") or CUDA VMM ("cuda"), whose
  ``allocate(nbytes)`` returns addresses; the host backend runs every state and policy without a GPU.

Errors: ValueError for a bad argument (an unknown tag, a tag reused with another policy), StateError (a
RuntimeError) for a call in the wrong state (pausing a paused tag, resuming an active one, allocating under a
paused tag), MemoryError when physical memory cannot be had, RuntimeError otherwise. Freeing a paused
allocation is allowed and gives back its memory and its copy.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional, Sequence, Tuple

__all__ = [
    "BACKUPS",
    "PreloadedSaver",
    "Saver",
    "StateError",
    "TagStats",
    "preload_library",
    "preloaded",
]

BACKUPS = ("none", "cpu", "restore_from")
_PRELOAD_NAME = "libdeltatrain_memsaver_preload.so"


class StateError(RuntimeError):
    """A call in the wrong state: pausing a paused tag, resuming an active one, allocating under a paused tag."""


@dataclass(frozen=True)
class TagStats:
    tag: str
    backup: str
    state: str  # "active" or "paused"
    allocations: int
    bytes: int
    reserved_bytes: int  # address space, rounded up to the backend's granularity
    mapped_bytes: int  # physical memory held now
    backup_bytes: int  # bytes a resume restores
    host_bytes_held: int  # host memory the saver keeps for this tag


def _backup_index(backup: str) -> int:
    if backup not in BACKUPS:
        raise ValueError(f"invalid argument 'backup': must be one of {', '.join(BACKUPS)}, got {backup!r}")
    return BACKUPS.index(backup)


Segment = Tuple[int, int, int]  # (device address, host address, bytes)


class _SaverBase:
    """What both savers offer; subclasses provide the _region_* hooks and the calls themselves."""

    @contextlib.contextmanager
    def region(self, tag: str, backup: str = "none") -> Iterator[None]:
        """Allocations of this thread inside the block go to the saver under `tag` with policy `backup`."""
        _backup_index(backup)
        self._region_enter(tag, backup)
        try:
            yield
        finally:
            self._region_exit()

    def register_tensor_backup(self, tag: str, pairs: Iterable[Tuple[object, object]]) -> None:
        """register_backup() from (device tensor, host tensor) pairs: each host tensor restores its device tensor.

        The host tensors are the caller's (the trainer's pinned weights backup) and must outlive the
        registration; both sides must be contiguous and of equal size in bytes.
        """
        segments = []
        for index, (device, host) in enumerate(pairs):
            for name, tensor in (("device", device), ("host", host)):
                if not tensor.is_contiguous():
                    raise ValueError(f"invalid argument 'pairs[{index}].{name}': must be contiguous")
            if device.nbytes != host.nbytes:
                raise ValueError(
                    f"invalid argument 'pairs[{index}]': device and host must have the same size in bytes, "
                    f"got {device.nbytes} and {host.nbytes}"
                )
            segments.append((device.data_ptr(), host.data_ptr(), device.nbytes))
        self.register_backup(tag, segments)

    def stats(self) -> dict:
        """TagStats of every tag, by tag."""
        return {entry.tag: entry for entry in self._stats()}


class Saver(_SaverBase):
    """A saver of this process's own: ``allocate(nbytes)`` inside ``region()`` returns an address."""

    def __init__(self, backend: str = "host", device: int = 0, chunk_bytes: int = 64 << 20):
        from . import _deltatrain  # the compiled module is needed here only

        self._saver = _deltatrain.memsaver.Saver(backend, device, chunk_bytes)
        self._regions = threading.local()

    @property
    def backend(self) -> str:
        return self._saver.backend

    @property
    def granularity(self) -> int:
        return self._saver.granularity

    def _open_regions(self) -> list:
        if not hasattr(self._regions, "stack"):
            self._regions.stack = []
        return self._regions.stack

    def _region_enter(self, tag: str, backup: str) -> None:
        if not tag:
            raise ValueError("invalid argument 'tag': must not be empty (no tag means every tag)")
        self._open_regions().append((tag, backup))

    def _region_exit(self) -> None:
        self._open_regions().pop()

    def allocate(self, nbytes: int) -> int:
        """Address of `nbytes` of fresh memory under the innermost region of this thread."""
        regions = self._open_regions()
        if not regions:
            raise StateError("allocate() needs a region open on this thread: use `with saver.region(tag, backup):`")
        tag, backup = regions[-1]
        return self._saver.allocate(tag, backup, nbytes)

    def free(self, address: int) -> None:
        self._saver.free(address)

    def contains(self, address: int) -> bool:
        return self._saver.contains(address)

    def pause(self, tag: Optional[str] = None) -> None:
        self._saver.pause(tag)

    def resume(self, tag: Optional[str] = None) -> None:
        self._saver.resume(tag)

    def register_backup(self, tag: str, segments: Sequence[Segment]) -> None:
        self._saver.register_backup(tag, [tuple(segment) for segment in segments])

    def unregister_backup(self, tag: str) -> None:
        self._saver.unregister_backup(tag)

    def device_bytes_in_use(self) -> int:
        return self._saver.device_bytes_in_use()

    def _stats(self) -> list:
        return [TagStats(**entry) for entry in self._saver.stats()]


class _TagStatsStruct(ctypes.Structure):
    _fields_ = [
        ("tag", ctypes.c_char * 128),
        ("backup", ctypes.c_int32),
        ("paused", ctypes.c_int32),
        ("allocations", ctypes.c_uint64),
        ("bytes", ctypes.c_uint64),
        ("reserved_bytes", ctypes.c_uint64),
        ("mapped_bytes", ctypes.c_uint64),
        ("backup_bytes", ctypes.c_uint64),
        ("host_bytes_held", ctypes.c_uint64),
    ]


_ABI_VERSION = 1
# deltatrain_memsaver_status -> exception type (include/deltatrain/memsaver/preload.h)
_STATUS_ERRORS = {1: ValueError, 2: StateError, 3: RuntimeError, 4: RuntimeError, 5: MemoryError}


class PreloadedSaver(_SaverBase):
    """The LD_PRELOAD shim's saver, through its C interface; get it with preloaded()."""

    def __init__(self, library: ctypes.CDLL):
        self._lib = library
        library.deltatrain_memsaver_last_error.restype = ctypes.c_char_p
        library.deltatrain_memsaver_region_enter.argtypes = [ctypes.c_char_p, ctypes.c_int]
        for name in ("pause", "resume", "unregister_backup"):
            getattr(library, f"deltatrain_memsaver_{name}").argtypes = [ctypes.c_char_p]
        library.deltatrain_memsaver_register_backup.argtypes = [
            ctypes.c_char_p,
            ctypes.POINTER(ctypes.c_uint64),
            ctypes.POINTER(ctypes.c_uint64),
            ctypes.POINTER(ctypes.c_uint64),
            ctypes.c_uint64,
        ]
        library.deltatrain_memsaver_stats.argtypes = [
            ctypes.POINTER(_TagStatsStruct),
            ctypes.c_int,
            ctypes.POINTER(ctypes.c_int),
        ]
        library.deltatrain_memsaver_device_bytes_in_use.argtypes = [ctypes.POINTER(ctypes.c_uint64)]
        self._pools = {}
        self._pools_lock = threading.Lock()

    def _check(self, status: int) -> None:
        if status != 0:
            message = self._lib.deltatrain_memsaver_last_error().decode("utf-8", "replace")
            raise _STATUS_ERRORS.get(status, RuntimeError)(message)

    @staticmethod
    def _encode(tag: Optional[str]) -> Optional[bytes]:
        return None if tag is None else tag.encode("utf-8")

    def _pool(self, key) -> Optional[object]:
        """The torch MemPool of a region, when torch drives CUDA in this process; None otherwise."""
        torch = sys.modules.get("torch")
        if torch is None or not torch.cuda.is_available():
            return None
        key = key + (torch.cuda.current_device(),)
        with self._pools_lock:
            if key not in self._pools:
                self._pools[key] = torch.cuda.MemPool()
            return self._pools[key]

    @contextlib.contextmanager
    def _scope(self, tag: Optional[str], backup: str) -> Iterator[None]:
        self._check(self._lib.deltatrain_memsaver_region_enter(self._encode(tag), _backup_index(backup)))
        try:
            pool = self._pool((tag, backup))
            if pool is None:
                yield
            else:
                with sys.modules["torch"].cuda.use_mem_pool(pool):
                    yield
        finally:
            self._check(self._lib.deltatrain_memsaver_region_exit())

    @contextlib.contextmanager
    def region(self, tag: str, backup: str = "none") -> Iterator[None]:
        """CUDA allocations of this thread inside the block come from the saver under `tag`."""
        if tag is None:
            raise ValueError("invalid argument 'tag': must be a string (use disabled() for a scope outside the saver)")
        with self._scope(tag, backup):
            yield

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Allocations inside bypass the saver even within a region (buffers that must never move)."""
        with self._scope(None, "none"):
            yield

    def pause(self, tag: Optional[str] = None) -> None:
        self._check(self._lib.deltatrain_memsaver_pause(self._encode(tag)))

    def resume(self, tag: Optional[str] = None) -> None:
        self._check(self._lib.deltatrain_memsaver_resume(self._encode(tag)))

    def register_backup(self, tag: str, segments: Sequence[Segment]) -> None:
        segments = [tuple(segment) for segment in segments]
        for index, segment in enumerate(segments):
            if len(segment) != 3 or any(int(value) < 0 for value in segment):
                raise ValueError(
                    f"invalid argument 'segments[{index}]': must be (device, host, bytes), non-negative, got {segment}"
                )
        columns = [(ctypes.c_uint64 * len(segments))(*(int(s[i]) for s in segments)) for i in range(3)]
        self._check(self._lib.deltatrain_memsaver_register_backup(self._encode(tag), *columns, len(segments)))

    def unregister_backup(self, tag: str) -> None:
        self._check(self._lib.deltatrain_memsaver_unregister_backup(self._encode(tag)))

    def device_bytes_in_use(self) -> int:
        value = ctypes.c_uint64()
        self._check(self._lib.deltatrain_memsaver_device_bytes_in_use(ctypes.byref(value)))
        return value.value

    def _stats(self) -> list:
        count = ctypes.c_int()
        self._check(self._lib.deltatrain_memsaver_stats(None, 0, ctypes.byref(count)))
        entries = (_TagStatsStruct * max(count.value, 1))()
        self._check(self._lib.deltatrain_memsaver_stats(entries, count.value, ctypes.byref(count)))
        return [
            TagStats(
                tag=entry.tag.decode("utf-8"),
                backup=BACKUPS[entry.backup],
                state="paused" if entry.paused else "active",
                allocations=entry.allocations,
                bytes=entry.bytes,
                reserved_bytes=entry.reserved_bytes,
                mapped_bytes=entry.mapped_bytes,
                backup_bytes=entry.backup_bytes,
                host_bytes_held=entry.host_bytes_held,
            )
            for entry in entries[: count.value]
        ]


def preload_library() -> str:
    """Path of the LD_PRELOAD shim: $DELTATRAIN_MEMSAVER_PRELOAD, else the one installed beside this module."""
    path = os.environ.get("DELTATRAIN_MEMSAVER_PRELOAD") or os.path.join(os.path.dirname(__file__), _PRELOAD_NAME)
    if not os.path.exists(path):
        raise RuntimeError(
            f"the memsaver preload shim is not at {path}: this build of deltatrain has no CUDA support, or set "
            "DELTATRAIN_MEMSAVER_PRELOAD to the built libdeltatrain_memsaver_preload.so"
        )
    return path


_preloaded: Optional[PreloadedSaver] = None
_preloaded_lock = threading.Lock()


def preloaded() -> PreloadedSaver:
    """The shim's saver in this process; RuntimeError when the process was not started with it in LD_PRELOAD."""
    global _preloaded
    with _preloaded_lock:
        if _preloaded is None:
            process = ctypes.CDLL(None)
            if not hasattr(process, "deltatrain_memsaver_abi_version"):
                raise RuntimeError(
                    "the memsaver shim is not loaded in this process: start it with LD_PRELOAD=<preload_library()>"
                )
            version = process.deltatrain_memsaver_abi_version()
            if version != _ABI_VERSION:
                raise RuntimeError(f"the preloaded memsaver shim has interface version {version}, expected {_ABI_VERSION}")
            _preloaded = PreloadedSaver(process)
        return _preloaded
