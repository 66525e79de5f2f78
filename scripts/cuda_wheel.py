#!/usr/bin/env python3
"""Build llama-cpp-python's CUDA wheel for the lent card on this CPU machine, so that issue 54's lent call unpacks
it in seconds instead of building for 250 of its 900 device seconds.

    python scripts/cuda_wheel.py            # ~20-40 min on 2 cores; again: seconds (kept), or incremental

It downloads the CUDA 13.0 toolkit's pip wheels (TOOLKIT: nvcc, the runtime and cuBLAS, CCCL's headers, NVVM), the
versions of the image's nvcc 13.0 (.library/device/KINDS.md), unpacks them into .gpu/cuda/toolkit as a toolkit
folder (lib64, the unversioned .so links CMake looks for, and a stub libcuda.so: the driver is the lent machine's),
and builds the pinned sdist with CUDA for sm_90 (H100, H200) into .gpu/cuda/. The wheel, as pip would install it,
goes into TREE there (pack_tree: a 138 MiB wheel, 19.7 MiB packed), beside a BUILT line. Both are kept outside the
clone too (kept(): the pin's cache folder, keyed by this script's bytes, which hold every input but the pin), so a
later clone or session on this machine copies them instead of building: .gpu/ is a clone's, the cache is the home's.
The CPU backend is built for AVX2 machines, not -march=native: the lent machine's CPU is not this one.
scripts/pack_scale.py carries TREE when it is there; scripts/gpu_scale.sh unpacks it, checks that it loads and
offloads, and builds from the sdist as before where it does not.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import fetch_llama_cpp  # noqa: E402
from pin import read_pin  # noqa: E402

OUT = ROOT / ".gpu" / "cuda"
TOOLKIT = {"nvidia-cuda-nvcc": "13.0.88", "nvidia-cuda-runtime": "13.0.96", "nvidia-cublas": "13.0.2.14",
           "nvidia-cuda-cccl": "13.0.85", "nvidia-cuda-crt": "13.0.88", "nvidia-nvvm": "13.0.88"}
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux_2_12_x86_64", "manylinux2010_x86_64")
ARCH = "90-real"  # H100 and H200: their machine code only, no PTX
# the driver entry points ggml-cuda calls (its virtual-memory pool); the stub only satisfies the link
DRIVER_SYMBOLS = ("cuDeviceGet", "cuDeviceGetAttribute", "cuGetErrorString", "cuMemAddressFree", "cuMemAddressReserve",
                  "cuMemCreate", "cuMemGetAllocationGranularity", "cuMemMap", "cuMemRelease", "cuMemSetAccess",
                  "cuMemUnmap")
BUILT = "BUILT"  # what the build was made from, one line; pack_scale.py carries it beside TREE
TREE = "llama_cpp_python-cuda.tar.xz"  # the installed package (llama_cpp/ and its dist-info), what the call unpacks


class WheelError(Exception):
    """A one-line reason the wheel cannot be built (exit 2)."""


def kept() -> Path:
    """Where a finished build's TREE and BUILT are kept: under the pin's cache folder, keyed by this file (the
    toolkit's versions, the architecture, the CMake flags and pack_tree's format are all in it)."""
    key = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
    return read_pin().cache_dir / f"cuda-{key}"


def _copy_build(src: Path, dst: Path) -> None:
    """TREE and BUILT from src into dst, each written aside and then renamed: a cut copy is never taken for one."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in (TREE, BUILT):
        shutil.copy2(src / name, dst / f".{name}.part")
    for name in (TREE, BUILT):
        (dst / f".{name}.part").replace(dst / name)


def restore() -> Path | None:
    """Copy a kept build into OUT, where one is kept for this script and pin: where it was kept (None: none is)."""
    keep = kept()
    if not all((keep / name).is_file() for name in (TREE, BUILT)):
        return None
    _copy_build(keep, OUT)
    return keep


def keep_build() -> Path:
    """Copy OUT's TREE and BUILT to kept(): where they are kept."""
    keep = kept()
    _copy_build(OUT, keep)
    return keep


def shown(path: Path) -> Path:
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def run(cmd: list[str], what: str, **kw) -> None:
    r = subprocess.run(cmd, **kw)
    if r.returncode:
        raise WheelError(f"{what} failed (exit {r.returncode})")


def toolkit() -> Path:
    """The toolkit folder, made from TOOLKIT's wheels where it is not there yet."""
    root = OUT / "toolkit"
    cu = root / "nvidia" / "cu13"
    if (cu / "bin" / "nvcc").exists() and (cu / "lib64" / "stubs" / "libcuda.so").exists():
        return cu
    wheels = OUT / "toolkit-wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
         "--implementation", "cp", *platforms, "-d", str(wheels), *(f"{n}=={v}" for n, v in TOOLKIT.items())],
        "downloading the CUDA toolkit's wheels")
    for w in sorted(wheels.glob("*.whl")):
        with zipfile.ZipFile(w) as z:
            z.extractall(root)
    for f in (cu / "bin").iterdir():
        f.chmod(0o755)
    for f in (cu / "nvvm" / "bin").iterdir():
        f.chmod(0o755)
    lib = cu / "lib"
    for name in ("libcudart", "libcublas", "libcublasLt"):
        (lib / f"{name}.so").unlink(missing_ok=True)
        (lib / f"{name}.so").symlink_to(f"{name}.so.13")
    (cu / "lib64").unlink(missing_ok=True)
    (cu / "lib64").symlink_to("lib")
    stubs = lib / "stubs"
    stubs.mkdir(exist_ok=True)
    (stubs / "stub.c").write_text("".join(f"void {s}(void) {{}}\n" for s in DRIVER_SYMBOLS))
    run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", str(stubs / "stub.c"), "-o", str(stubs / "libcuda.so")],
        "building the stub libcuda.so")
    return cu


def build(cu: Path) -> Path:
    """The wheel, built from the pinned sdist (the build folder kept: a rerun is incremental)."""
    pin = read_pin()
    try:
        sdist = fetch_llama_cpp.download(pin)
    except SystemExit as e:
        raise WheelError(str(e.code).removeprefix("error: ")) from None
    src = OUT / "src"  # unpacked once: a build folder's CMake cache names its source folder
    if not (src / "pyproject.toml").exists():
        src.mkdir(parents=True, exist_ok=True)
        run(["tar", "-xzf", str(sdist), "-C", str(src), "--strip-components", "1"], f"unpacking {sdist.name}")
    for old in [*OUT.glob("llama_cpp_python-*.whl"), OUT / TREE, OUT / BUILT]:
        old.unlink(missing_ok=True)
    cmake_args = ["-DGGML_CUDA=on", f"-DCMAKE_CUDA_ARCHITECTURES={ARCH}", "-DLLAVA_BUILD=OFF", "-DGGML_NATIVE=OFF",
                  "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", f"-DCUDAToolkit_ROOT={cu}",
                  f"-DCMAKE_CUDA_COMPILER={cu / 'bin' / 'nvcc'}"]
    env = {**os.environ, "CMAKE_ARGS": " ".join(cmake_args), "PATH": f"{cu / 'bin'}:{os.environ['PATH']}",
           "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 2)}
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir", "-C", f"build-dir={OUT / 'build'}",
         "-w", str(OUT), str(src)], "building llama-cpp-python with CUDA", env=env)
    got = sorted(OUT.glob(f"llama_cpp_python-{pin.version}-*.whl"))
    if len(got) != 1:
        raise WheelError(f"the build left {len(got)} wheels of {pin.version} in {OUT}")
    (OUT / BUILT).write_text(f"{pin.sdist} sha256 {pin.sha256}, CUDA {TOOLKIT['nvidia-cuda-nvcc']}, sm_{ARCH}, "
                             f"CPU backend AVX2\n")
    return got[0]


def pack_tree(wheel: Path) -> Path:
    """TREE: the wheel's llama_cpp/ and dist-info, each library once and its other names symlinks to it. A wheel
    cannot hold symlinks, so the build's libggml-cuda.so, .so.0 and .so.0.25.3 are three copies in it, twice over
    (its lib/ folder too, which llama_cpp does not load)."""
    out = OUT / TREE
    kept: dict[tuple[str, str], str] = {}  # (a library's folder, its sha256) -> the name it is kept under
    with zipfile.ZipFile(wheel) as z, tarfile.open(out, "w:xz", preset=9) as tar:
        names = [n for n in z.namelist() if n.startswith(("llama_cpp/", "llama_cpp_python-")) and not n.endswith("/")]
        for name in sorted(names, key=lambda n: (n.rpartition("/")[0], -len(n), n)):  # a library's longest name first
            data = z.read(name)
            info = tarfile.TarInfo(name)
            library = ".so" in name.rpartition("/")[2]
            if library:
                key = (name.rpartition("/")[0], hashlib.sha256(data).hexdigest())
                if key in kept:
                    info.type, info.linkname = tarfile.SYMTYPE, kept[key].rpartition("/")[2]
                    tar.addfile(info)
                    continue
                kept[key] = name
            info.size, info.mode = len(data), 0o755 if library else 0o644
            tar.addfile(info, io.BytesIO(data))
    return out


def main() -> int:
    if len(sys.argv) > 1:
        print("error: cuda_wheel.py takes no arguments (see its docstring)", file=sys.stderr)
        return 2
    try:
        keep = restore()
        if keep is not None:
            tree = OUT / TREE
            print(f"{shown(tree)}: {tree.stat().st_size / 2**20:.1f} MiB, the build kept in {keep} "
                  f"({(OUT / BUILT).read_text().strip()}); python scripts/pack_scale.py carries it")
            return 0
        wheel = build(toolkit())
        tree = pack_tree(wheel)
    except (WheelError, OSError, zipfile.BadZipFile, tarfile.TarError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        kept_in = f"kept in {keep_build()}"
    except OSError as e:  # the build in OUT stands; only a later clone's shortcut is lost
        kept_in = f"not kept ({e}: a later clone builds again)"
    print(f"{shown(wheel)}: {wheel.stat().st_size / 2**20:.1f} MiB, as installed {shown(tree)} "
          f"{tree.stat().st_size / 2**20:.1f} MiB, {kept_in}; python scripts/pack_scale.py carries the latter")
    return 0


if __name__ == "__main__":
    sys.exit(main())
