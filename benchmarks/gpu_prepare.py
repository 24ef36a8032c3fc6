"""Prepare the GPU check on a CPU machine: what a bare GPU machine with no package index needs.

    python benchmarks/gpu_prepare.py

The lent GPU machines run an image with Python 3.12, torch, triton and transformers, and no
package index. This writes two ignored folders of the checkout, which the device call
carries (``carry: [".whl", ".gpu-data"]``):

- ``.whl/``: cp312 manylinux wheels of every package that tokenmill, the ``openai`` client
  (the server test) and ``xgrammar`` (structured outputs) need and the image lacks
  (``benchmarks/gpu_image_packages.txt``), each at the version installed here, so the GPU
  runs what the CPU suite tested. ``gpu_check.sh`` installs them with ``--no-index --no-deps``;
- ``.gpu-data/quant-checkpoints``: the shared FP8, GPTQ and AWQ checkpoints the GPU suite
  reads (``../shared`` does not travel).

It prints the total size: a device call carries at most 64 MiB with the checkout.
"""

from __future__ import annotations

import importlib.metadata as metadata
import re
import shutil
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / ".whl"
DATA = ROOT / ".gpu-data"
SHARED_CHECKPOINTS = ROOT.parent / "shared" / "quant-checkpoints"
#: what the GPU suite imports beyond tokenmill's own requirements, and the suite's report log (a line per test as it ends)
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


def size_mib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20 if path.exists() else 0.0


def main() -> None:
    packages = missing_packages()
    print("wheels:", " ".join(f"{n}=={v}" for n, v in sorted(packages.items())))
    download(packages)
    copy_checkpoints()
    checkout = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    tracked = sum((ROOT / name).stat().st_size for name in checkout.decode().split("\0") if name
                  and (ROOT / name).is_file()) / 2**20
    print(f".whl {size_mib(WHEELS):.1f} MiB, .gpu-data {size_mib(DATA):.1f} MiB, tracked files {tracked:.1f} MiB "
          "(a device call carries 64 MiB in all)")


if __name__ == "__main__":
    main()
