"""Prepare the GPU check on a CPU machine: what a bare GPU machine with no package index needs.

    python benchmarks/gpu_prepare.py

The lent GPU machines run an image with Python 3.12, torch, triton and transformers, and no
package index. This writes three ignored folders of the checkout, which the device call
carries (``carry: [".whl", ".gpu-data", ".triton-cache"]``):

- ``.whl/``: cp312 manylinux wheels of every package that tokenmill, the ``openai`` client
  (the server test) and ``xgrammar`` (structured outputs) need and the image lacks
  (``benchmarks/gpu_image_packages.txt``), each at the version installed here, so the GPU
  runs what the CPU suite tested. ``gpu_check.sh`` installs them with ``--no-index --no-deps``;
- ``.gpu-data/quant-checkpoints``: the shared FP8, GPTQ and AWQ checkpoints the GPU suite
  reads (``../shared`` does not travel);
- ``.triton-cache/``: every Triton kernel the GPU check's engines launch, compiled for sm_90 by the
  image's Triton release (``tokenmill.testing.triton_cache``, in a venv with that release; the
  cache key of the image's Python, 3.12, comes from a second venv on a ``python3.12`` found here),
  with the specializations a GPU recorded (``benchmarks/results/gpu-triton-specializations.jsonl``,
  the check's ``triton.jsonl``) compiled first. Without a ``python3.12`` it is left out, and the
  GPU compiles its kernels itself.

It prints the total size: a device call carries at most 64 MiB with the checkout.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / ".whl"
DATA = ROOT / ".gpu-data"
KERNELS = ROOT / ".triton-cache"
#: where gpu_check.sh puts the cache on the GPU machine (group files name their members by absolute path)
GPU_CACHE = Path("/tmp/tokenmill-triton-cache")
#: the Triton specializations a GPU check used (its triton.jsonl, committed)
RECORDS = ROOT / "benchmarks" / "results" / "gpu-triton-specializations.jsonl"
SHARED_CHECKPOINTS = ROOT.parent / "shared" / "quant-checkpoints"
#: what the GPU suite imports beyond tokenmill's requirements, and the suite's report log (a line per test as it ends)
EXTRA = ["openai", "xgrammar", "pytest-reportlog"]
#: in the image, but older than what the packages here require
ALWAYS = ["typing-extensions"]
#: the GPU machine's interpreter, for requirement markers
TARGET = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
          "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
          "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages() -> set[str]:
    text = (ROOT / "benchmarks" / "gpu_image_packages.txt").read_text()
    return {normalize(word) for line in text.splitlines() if not line.startswith("#") for word in line.split()}


def missing_packages() -> dict[str, str]:
    """name -> version installed here, for every package the closure needs and the image lacks."""
    image, seen, wanted = image_packages(), set(), {}

    def walk(name: str) -> None:
        key = normalize(name)
        if key in seen:
            return
        seen.add(key)
        distribution = metadata.distribution(name)
        if key != "tokenmill" and (key not in image or key in ALWAYS):
            wanted[distribution.metadata["Name"]] = distribution.version
        for line in distribution.requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate(TARGET):
                walk(requirement.name)

    for name in ["tokenmill", *EXTRA, *ALWAYS]:
        walk(name)
    return wanted


def download(packages: dict[str, str]) -> None:
    shutil.rmtree(WHEELS, ignore_errors=True)
    WHEELS.mkdir()
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
               "--python-version", "3.12", "--implementation", "cp", "-d", str(WHEELS)]
    for platform in PLATFORMS:
        command += ["--platform", platform]
    subprocess.run(command + [f"{name}=={version}" for name, version in sorted(packages.items())], check=True)


def copy_checkpoints() -> None:
    target = DATA / "quant-checkpoints"
    shutil.rmtree(target, ignore_errors=True)
    if not SHARED_CHECKPOINTS.is_dir():
        print(f"no shared checkpoints at {SHARED_CHECKPOINTS}: the GPU suite's FP8/GPTQ/AWQ tests will skip")
        return
    shutil.copytree(SHARED_CHECKPOINTS, target)


def image_triton() -> str:
    """The Triton release of the GPU image (gpu_image_packages.txt's header names it, as 3.6)."""
    version = re.search(r"triton (\d+\.\d+)", (ROOT / "benchmarks" / "gpu_image_packages.txt").read_text())
    return f"{version.group(1)}.0"


def venv_with_triton(python: str, path: Path, version: str, system_site: bool) -> Path:
    """``path``'s interpreter, a venv of ``python`` with ``triton==version`` installed (once)."""
    interpreter = path / "bin" / "python"
    check = [str(interpreter), "-c", "import triton; print(triton.__version__)"]
    if not interpreter.exists():
        subprocess.run([python, "-m", "venv", *(["--system-site-packages"] if system_site else []), str(path)],
                       check=True)
    if subprocess.run(check, capture_output=True, text=True).stdout.strip() != version:
        subprocess.run([str(interpreter), "-m", "pip", "install", "-q", "--no-deps", f"triton=={version}"], check=True)
    return interpreter


def python312() -> str | None:
    """A python3.12 that runs (pyenv's shim is on PATH where 3.12 is installed but not selected)."""
    pyenv = sorted(Path.home().glob(".pyenv/versions/3.12*/bin/python3.12"))
    candidates = [shutil.which("python3.12"), *map(str, pyenv)]
    return next((c for c in candidates if c and subprocess.run([c, "--version"], capture_output=True).returncode == 0),
                None)


def compile_kernels() -> None:
    """.triton-cache: the GPU check's Triton kernels, compiled here for the image's Triton and Python."""
    shutil.rmtree(KERNELS, ignore_errors=True)
    key_python = sys.executable if sys.version_info[:2] == (3, 12) else python312()
    if key_python is None:
        print("no python3.12 here (the GPU image's): no .triton-cache, the GPU compiles its Triton kernels itself")
        return
    version, scratch = image_triton(), Path(tempfile.gettempdir())
    keyed = venv_with_triton(key_python, scratch / f"tokenmill-triton-{version}-key", version, system_site=False)
    key = subprocess.run([str(keyed), "-c", "from triton.runtime.cache import triton_key; print(triton_key())"],
                         capture_output=True, text=True, check=True).stdout.strip()
    compiler = venv_with_triton(sys.executable, scratch / f"tokenmill-triton-{version}", version, system_site=True)
    shutil.rmtree(GPU_CACHE, ignore_errors=True)
    command = [str(compiler), "-m", "tokenmill.testing.triton_cache", "build", str(GPU_CACHE), "--triton-key", key]
    if SHARED_CHECKPOINTS.is_dir():
        command += ["--checkpoints", str(SHARED_CHECKPOINTS)]
    if RECORDS.exists():
        command += ["--records", str(RECORDS)]
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(ROOT)}
    if subprocess.run(command, env=environment).returncode != 0:
        print("some kernels failed to compile (above): .triton-cache holds the others")
    if GPU_CACHE.is_dir():
        shutil.copytree(GPU_CACHE, KERNELS)


def size_mib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20 if path.exists() else 0.0


def main() -> None:
    try:
        packages = missing_packages()
    except metadata.PackageNotFoundError as missing:
        sys.exit(f"{missing.name} is not installed here: the GPU gets each package at the version installed here "
                 f"(pip install {missing.name}, then run this again)")
    print("wheels:", " ".join(f"{n}=={v}" for n, v in sorted(packages.items())))
    download(packages)
    copy_checkpoints()
    compile_kernels()
    checkout = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    tracked = sum((ROOT / name).stat().st_size for name in checkout.decode().split("\0") if name
                  and (ROOT / name).is_file()) / 2**20
    print(f".whl {size_mib(WHEELS):.1f} MiB, .gpu-data {size_mib(DATA):.1f} MiB, "
          f".triton-cache {size_mib(KERNELS):.1f} MiB, tracked files {tracked:.1f} MiB "
          "(a device call carries 64 MiB in all)")


if __name__ == "__main__":
    main()
