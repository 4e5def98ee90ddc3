"""ops/cuda_pdl.py's launch structures against the CUDA header, without a GPU.

The launcher builds a CUlaunchConfig and a kernelParams array in ctypes for the driver's
cuLaunchKernelEx. Here a small C function compiled against the toolkit's own cuda.h
stands where the driver's entry point would be: it reads the config and the parameters
through the header's types and writes back what it found, so a field at a wrong offset
or a value passed with a wrong width shows. Skipped where no cuda.h or C compiler is
installed. On a GPU, tests/test_cuda.py replays decode steps captured with these
launches against eager ones.
"""
from __future__ import annotations

import ctypes
import glob
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from ellm.ops import cuda_pdl

CUDA_H = next(iter(sorted(glob.glob("/usr/local/cuda*/include/cuda.h"))), None)
CC = shutil.which("gcc") or shutil.which("cc")
needs_header = pytest.mark.skipif(CUDA_H is None or CC is None,
                                  reason="needs the CUDA toolkit's cuda.h and a C compiler")

DRIVER_STANDIN = r"""
#include <cuda.h>
#include <stddef.h>
#include <string.h>

/* what the launch carried, for the test to read back */
unsigned long long seen[32];

int layout(unsigned long long* out) {
    out[0] = sizeof(CUlaunchConfig);
    out[1] = offsetof(CUlaunchConfig, sharedMemBytes);
    out[2] = offsetof(CUlaunchConfig, hStream);
    out[3] = offsetof(CUlaunchConfig, attrs);
    out[4] = offsetof(CUlaunchConfig, numAttrs);
    out[5] = sizeof(CUlaunchAttribute);
    out[6] = offsetof(CUlaunchAttribute, value);
    out[7] = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    return 8;
}

/* cuLaunchKernelEx's signature; the kernel here takes (float* x, int n, float s, long long m) */
CUresult launch_ex(const CUlaunchConfig* c, CUfunction f, void** params, void** extra) {
    seen[0] = c->gridDimX; seen[1] = c->gridDimY; seen[2] = c->gridDimZ;
    seen[3] = c->blockDimX; seen[4] = c->blockDimY; seen[5] = c->blockDimZ;
    seen[6] = c->sharedMemBytes; seen[7] = (unsigned long long)c->hStream;
    seen[8] = c->numAttrs; seen[9] = c->attrs[0].id;
    seen[10] = c->attrs[0].value.programmaticStreamSerializationAllowed;
    seen[11] = (unsigned long long)f; seen[12] = (unsigned long long)extra;
    seen[13] = (unsigned long long)*(float**)params[0];
    seen[14] = (unsigned long long)(long long)*(int*)params[1];
    float s; memcpy(&s, params[2], 4); seen[15] = (unsigned long long)(s * 1000.0f);
    seen[16] = (unsigned long long)*(long long*)params[3];
    return c->gridDimX == 0 ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}
"""


@pytest.fixture(scope="module")
def standin(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    folder = tmp_path_factory.mktemp("pdl")
    src, lib = folder / "driver.c", folder / "driver.so"
    src.write_text(DRIVER_STANDIN)
    include = str(Path(CUDA_H).parent)   # type: ignore[arg-type]
    proc = subprocess.run([CC, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-I", include, str(src),
                           "-o", str(lib)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return ctypes.CDLL(str(lib))


class _DeviceArray:
    """What the launcher reads of a CuPy array: `.data.ptr`."""

    class _Ptr:
        def __init__(self, ptr: int) -> None:
            self.ptr = ptr

    def __init__(self, ptr: int) -> None:
        self.data = self._Ptr(ptr)


@needs_header
def test_structures_match_cuda_h(standin: ctypes.CDLL) -> None:
    out = (ctypes.c_ulonglong * 8)()
    assert standin.layout(out) == 8
    LC, LA = cuda_pdl.LaunchConfig, cuda_pdl.LaunchAttribute
    ours = [ctypes.sizeof(LC), LC.sharedMemBytes.offset, LC.hStream.offset, LC.attrs.offset,
            LC.numAttrs.offset, ctypes.sizeof(LA), LA.value.offset, cuda_pdl.PROGRAMMATIC_STREAM_SERIALIZATION]
    assert ours == list(out)


@needs_header
def test_launch_passes_config_attribute_and_arguments(standin: ctypes.CDLL) -> None:
    fn = standin.launch_ex
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(cuda_pdl.LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    launch = cuda_pdl.DependentLauncher(fn)
    args = (_DeviceArray(0x7f00_1234_5600), np.int32(-7), np.float32(2.5), np.int64(1 << 40))
    launch(0xabc0, (30, 2), (256,), args, stream=0x5150, name="scale_like")
    seen = list((ctypes.c_ulonglong * 17).in_dll(standin, "seen"))
    assert seen[:13] == [30, 2, 1, 256, 1, 1, 0, 0x5150, 1, 6, 1, 0xabc0, 0]
    assert seen[13] == 0x7f00_1234_5600
    assert np.int64(np.uint64(seen[14])) == -7
    assert seen[15] == 2500 and seen[16] == 1 << 40
    with pytest.raises(RuntimeError, match=r"cuLaunchKernelEx\(scale_like, grid \(0, 1, 1\).*CUDA error 1"):
        launch(0xabc0, (0,), (256,), args, stream=0x5150, name="scale_like")


def test_arguments_of_other_types_are_refused_by_name() -> None:
    with pytest.raises(TypeError, match="gemv_q4_0: argument 1 is int"):
        cuda_pdl.kernel_params("gemv_q4_0", (_DeviceArray(16), 5))
    with pytest.raises(TypeError, match="argument 0 is ndarray"):
        cuda_pdl.kernel_params("k", (np.zeros(3, np.float32),))
    # ops/cuda.py's null pointer (no bias) is np.uintp(0): 8 bytes of zero
    params, keep = cuda_pdl.kernel_params("k", (np.uint32(0xffffffff), np.float64(0.5), np.uintp(0)))
    assert ctypes.cast(params[0], ctypes.POINTER(ctypes.c_uint32))[0] == 0xffffffff
    assert ctypes.cast(params[1], ctypes.POINTER(ctypes.c_double))[0] == 0.5
    assert ctypes.sizeof(keep[2]) == 8 and ctypes.cast(params[2], ctypes.POINTER(ctypes.c_uint64))[0] == 0
    assert len(keep) == 3


def test_without_a_driver_the_launcher_is_not_made() -> None:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        with pytest.raises(OSError):
            cuda_pdl.DependentLauncher.from_driver()
    else:
        pytest.skip("a CUDA driver is installed here (tests/test_cuda.py uses it)")
