"""deltatrain.memsaver from Python: the in-process saver on host pages, and the LD_PRELOAD shim's saver
driven through ctypes in a child process (host backend, so no GPU is needed)."""

import ctypes
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from deltatrain import memsaver


def view(address, nbytes):
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))


@pytest.fixture
def saver():
    return memsaver.Saver("host")


def test_cpu_copy_comes_back_bitwise_at_the_same_address(saver, rng):
    nbytes = int(rng.integers(1, 1 << 20))
    with saver.region("optimizer", "cpu"):
        address = saver.allocate(nbytes)
    data = rng.integers(0, 256, nbytes, dtype=np.uint8)
    view(address, nbytes)[:] = data
    before = saver.device_bytes_in_use()
    saver.pause("optimizer")
    stats = saver.stats()["optimizer"]
    assert stats.state == "paused" and stats.mapped_bytes == 0 and stats.host_bytes_held == nbytes
    assert before - saver.device_bytes_in_use() == stats.reserved_bytes
    saver.resume()
    np.testing.assert_array_equal(view(address, nbytes), data)
    saver.free(address)
    assert not saver.contains(address)


def test_restore_from_registered_backup_reads_the_callers_copy_at_resume(saver, rng):
    nbytes = int(rng.integers(1, 1 << 16))
    with saver.region("params", "restore_from"):
        address = saver.allocate(nbytes)
    weights = rng.integers(0, 256, nbytes, dtype=np.uint8)
    saver.register_backup("params", [(address, weights.ctypes.data, nbytes)])
    saver.pause()
    weights[:] = rng.integers(0, 256, nbytes, dtype=np.uint8)
    saver.resume("params")
    np.testing.assert_array_equal(view(address, nbytes), weights)
    assert saver.stats()["params"].host_bytes_held == 0
    saver.unregister_backup("params")


def test_wrong_calls_raise_typed_errors(saver):
    with pytest.raises(memsaver.StateError):
        saver.allocate(4096)  # no region open
    with saver.region("grads"):
        address = saver.allocate(4096)
        with pytest.raises(ValueError, match="backup"):
            with saver.region("grads", "cpu"):
                saver.allocate(4096)
    with pytest.raises(ValueError, match="backup"):
        with saver.region("grads", "disk"):
            pass
    with pytest.raises(ValueError, match="unknown"):
        saver.pause("nowhere")
    with pytest.raises(memsaver.StateError):
        saver.resume("grads")
    saver.pause("grads")
    with pytest.raises(memsaver.StateError):
        saver.pause("grads")
    with pytest.raises(memsaver.StateError):
        with saver.region("grads"):
            saver.allocate(4096)
    with pytest.raises(ValueError, match="address"):
        saver.free(address + 1)
    saver.free(address)  # a paused allocation may be freed
    assert saver.stats()["grads"].allocations == 0
    assert issubclass(memsaver.StateError, RuntimeError)


CHILD = textwrap.dedent(
    """
    import ctypes, sys
    import numpy as np
    sys.path.insert(0, {package_root!r})
    from deltatrain import memsaver

    saver = memsaver.preloaded()
    runtime = ctypes.CDLL(None)  # cudaMalloc/cudaFree resolve to the shim first
    runtime.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
    runtime.cudaFree.argtypes = [ctypes.c_void_p]
    rng = np.random.default_rng({seed})
    nbytes = int(rng.integers(1, 1 << 20))
    pointer = ctypes.c_void_p()
    with saver.region("optimizer", "cpu"):
        assert runtime.cudaMalloc(ctypes.byref(pointer), nbytes) == 0
    memory = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(pointer.value))
    data = rng.integers(0, 256, nbytes, dtype=np.uint8)
    memory[:] = data
    before = saver.device_bytes_in_use()
    saver.pause()
    assert saver.stats()["optimizer"].state == "paused"
    assert before - saver.device_bytes_in_use() == saver.stats()["optimizer"].reserved_bytes
    try:
        saver.pause("optimizer")
        raise SystemExit("pausing a paused tag did not raise")
    except memsaver.StateError as error:
        assert "already paused" in str(error)
    try:
        saver.resume("nowhere")
        raise SystemExit("an unknown tag did not raise")
    except ValueError:
        pass
    saver.resume()
    assert (memory == data).all()
    with saver.region("optimizer", "cpu"), saver.disabled():
        outside = ctypes.c_void_p()
        # no CUDA runtime behind the shim in this process: the forwarded call fails, proving it left the saver
        assert runtime.cudaMalloc(ctypes.byref(outside), 64) != 0
    assert runtime.cudaFree(pointer) == 0
    assert saver.stats()["optimizer"].allocations == 0
    print("child ok")
    """
)


def test_the_preloaded_shim_is_driven_through_ctypes(rng):
    try:
        shim = memsaver.preload_library()
    except RuntimeError as error:
        pytest.skip(str(error))
    package_root = os.path.dirname(os.path.dirname(memsaver.__file__))
    script = CHILD.format(package_root=package_root, seed=int(rng.integers(1 << 32)))
    environment = dict(os.environ, LD_PRELOAD=shim, DELTATRAIN_MEMSAVER_BACKEND="host")
    result = subprocess.run([sys.executable, "-c", script], env=environment, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "child ok" in result.stdout


def test_preloaded_without_the_shim_says_how_to_start_it():
    if "deltatrain_memsaver_abi_version" in dir(ctypes.CDLL(None)) or os.environ.get("LD_PRELOAD"):
        pytest.skip("a shim may be preloaded here")
    with pytest.raises(RuntimeError, match="LD_PRELOAD"):
        memsaver.preloaded()
