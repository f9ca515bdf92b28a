"""Install the real SGLang wheels the conformance tier runs against, cached under .cache/.

``python tests/conformance/install_sglang.py`` installs, for every tested SGLang version (the
project's floor and the newest release it was tested with), the ``sglang`` wheel plus the few
small modules its HTTP server and argument parser import at module level that the venv
lacks, each with ``pip install --no-deps --target .cache/sglang-conformance/<version>/``.
Packages tied to the venv's torch rather than to SGLang (triton, torchvision) go once into
``.cache/sglang-conformance/torch-<major.minor>/``. Nothing is installed into the venv, and a
target that would shadow a venv package (torch, transformers, ...) is refused.

The GPU kernel package (``sgl_kernel``) is not installed: a stand-in that holds no kernels
(``tests/conformance/kernel_standin.py``) is written in its place. A second run finds the
stamp files and downloads nothing. It prints what it downloaded, how many MB, and how long.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import importlib.metadata
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from areal.api.config.inference import MAX_SGLANG_VERSION, MIN_SGLANG_VERSION

__all__ = [
    "CACHE_DIR",
    "VERSIONS",
    "IndexUnreachableError",
    "InstallError",
    "SGLangSite",
    "ensure_installed",
]

REPO_ROOT = Path(__file__).resolve().parents[2]
CACHE_DIR = REPO_ROOT / ".cache" / "sglang-conformance"
VERSIONS = (MIN_SGLANG_VERSION, MAX_SGLANG_VERSION)

# Modules SGLang's server_args / http_server / model runner import at module level that the
# venv lacks (each one is imported; several are small compiled wheels, none is a GPU package).
# Pinned: SGLang's own pin where its metadata has one (==), else the version tested here.
_COMMON_DEPS = (
    "pybase64==1.5.1",
    "ipython==9.18.1",  # sglang.utils: from IPython.display import HTML
    "traitlets==5.16.1",
    "pyzmq==27.3.0",
    "dill==0.4.1",
    "loguru==0.7.3",
    "msgspec==0.23.0",
    "setproctitle==1.3.8",
    "jsonschema==4.26.0",
    "jsonschema-specifications==2025.9.1",
    "referencing==0.37.0",
    "rpds-py==2026.9.1",
    "python-multipart==0.0.34",
    "partial-json-parser==0.2.1.1.post7",
)
_VERSION_DEPS = {
    "0.5.10.post1": ("sentencepiece==0.2.3", "compressed-tensors==0.20.1"),
    "0.5.23": (
        "sentencepiece==0.2.1",
        "compressed-tensors==0.18.0",
        "apache-tvm-ffi==0.1.11",
        "xgrammar==0.2.7",
        "soundfile==0.13.1",
        "cffi==2.1.1",  # soundfile's runtime (its bindings are precompiled: no pycparser)
    ),
}
# sglang.srt.utils imports triton unconditionally and sglang imports torchvision.transforms;
# both must match the venv's torch (torch 2.13's own triton pin; torchvision 0.28 = torch 2.13).
_TORCH_TIED = {"2.13": ("triton==3.7.1", "torchvision==0.28.0")}
# The GPU kernel package every tested version imports; replaced by a stand-in.
KERNEL_MODULES = ("sgl_kernel",)
_STANDIN_SOURCE = Path(__file__).with_name("kernel_standin.py")
_STAMP = ".conformance-install.json"
# pip's messages when the index cannot be reached at all (as opposed to a bad pin).
_UNREACHABLE_MARKERS = (
    "NewConnectionError",
    "Max retries exceeded",
    "Temporary failure in name resolution",
    "Network is unreachable",
    "Name or service not known",
    "Connection refused",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "ProxyError",
)


class InstallError(RuntimeError):
    """pip could not install a pinned package (a real failure, not a network outage)."""


class IndexUnreachableError(InstallError):
    """The package index (PyPI) cannot be reached from this machine."""


@dataclass
class SGLangSite:
    """The directories one SGLang version's checks put first on ``sys.path``, in order."""

    version: str
    paths: list[Path]
    downloaded_mb: float = 0.0
    seconds: float = 0.0
    downloads: list[str] = field(default_factory=list)


def requirements(version: str) -> list[str]:
    """Everything installed into ``<cache>/<version>/`` (sglang first)."""
    if version not in _VERSION_DEPS:
        raise InstallError(
            f"sglang {version} has no dependency list in {Path(__file__).name}; "
            f"tested versions: {', '.join(_VERSION_DEPS)}"
        )
    return [f"sglang=={version}", *_COMMON_DEPS, *_VERSION_DEPS[version]]


def torch_tied_requirements() -> tuple[str, list[str]]:
    """(``torch-<major.minor>`` directory name, its requirements) for the venv's torch."""
    torch_version = importlib.metadata.version("torch").split("+")[0]
    key = ".".join(torch_version.split(".")[:2])
    if key not in _TORCH_TIED:
        raise InstallError(
            f"no triton/torchvision pins for torch {torch_version} in {Path(__file__).name}; "
            "add torch's own triton pin and the matching torchvision to _TORCH_TIED"
        )
    return f"torch-{key}", list(_TORCH_TIED[key])


def ensure_installed(
    versions: tuple[str, ...] = VERSIONS, cache_dir: Path = CACHE_DIR, log=print
) -> dict[str, SGLangSite]:
    """Install what is missing (under a lock: other sessions may run this concurrently)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    sites: dict[str, SGLangSite] = {}
    with _locked(cache_dir / ".lock"):
        tied_name, tied_reqs = torch_tied_requirements()
        tied_dir = cache_dir / tied_name
        tied_mb, tied_s, tied_files = _install_dir(tied_dir, _not_in_venv(tied_reqs, log), log)
        for version in versions:
            target = cache_dir / version
            sglang, *deps = requirements(version)
            reqs = [sglang, *_not_in_venv(deps, log)]
            mb, seconds, files = _install_dir(target, reqs, log)
            _write_standins(target)
            sites[version] = SGLangSite(
                version, [target, tied_dir], mb + tied_mb, seconds + tied_s, files + tied_files
            )
            tied_mb, tied_s, tied_files = 0.0, 0.0, []  # counted once
    return sites


def _not_in_venv(reqs: list[str], log) -> list[str]:
    """Drop what the venv already has (e.g. triton beside a CUDA torch): the venv's copy wins."""
    kept = []
    for req in reqs:
        name = req.split("==")[0]
        try:
            have = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            kept.append(req)
            continue
        log(f"sglang-conformance: using the venv's {name} {have} instead of {req}")
    return kept


def _install_dir(target: Path, reqs: list[str], log) -> tuple[float, float, list[str]]:
    """Download the pinned wheels and install them into ``target`` (skipped when cached)."""
    stamp = target / _STAMP
    if stamp.is_file() and json.loads(stamp.read_text()).get("requirements") == reqs:
        log(f"sglang-conformance: {target.name}: cached ({len(reqs)} packages)")
        return 0.0, 0.0, []
    shutil.rmtree(target, ignore_errors=True)
    if not reqs:  # the venv has all of them
        target.mkdir(parents=True)
        (target / _STAMP).write_text(json.dumps({"requirements": reqs}))
        return 0.0, 0.0, []
    begin = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="wheels-", dir=target.parent) as wheels:
        _pip("download", "--no-deps", "--only-binary=:all:", "--dest", wheels, *reqs)
        download_s = time.monotonic() - begin
        files = sorted(Path(wheels).iterdir())
        sizes = {f.name: f.stat().st_size / 2**20 for f in files}
        partial = target.with_name(f"{target.name}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        # no bytecode now: the first import compiles only the modules the tier imports
        _pip("install", "--no-deps", "--no-compile", "--target", str(partial), *map(str, files))
    _refuse_shadowing(partial)
    seconds = time.monotonic() - begin
    total = sum(sizes.values())
    for name, mb in sizes.items():
        log(f"sglang-conformance: downloaded {name} ({mb:.1f} MB)")
    log(
        f"sglang-conformance: {target.name}: {len(files)} wheels, {total:.1f} MB; "
        f"download {download_s:.1f} s, install {seconds - download_s:.1f} s"
    )
    stamp_data = {"requirements": reqs, "wheels": sizes, "mb": round(total, 2), "s": seconds}
    (partial / _STAMP).write_text(json.dumps(stamp_data, indent=1))
    partial.rename(target)
    return total, seconds, [f"{name} ({mb:.1f} MB)" for name, mb in sizes.items()]


def _pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", *args, "--retries", "2", "--timeout", "30"]
    cmd += ["--disable-pip-version-check", "--no-input", "--quiet"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode == 0:
        return
    output = result.stdout + result.stderr
    kind = IndexUnreachableError if any(m in output for m in _UNREACHABLE_MARKERS) else InstallError
    raise kind(f"pip {args[0]} failed ({' '.join(args[-3:])} ...):\n{output[-3000:]}")


def _refuse_shadowing(target: Path) -> None:
    """A module installed here must not replace one the venv already has (torch, ...)."""
    venv = {Path(p).resolve() for p in sys.path if p.endswith("site-packages")}
    clashes = []
    for entry in target.iterdir():
        if entry.name in ("bin", "share", "include") or entry.name.startswith("__"):
            continue  # scripts and data files
        if entry.name.endswith((".dist-info", ".libs", ".data")):
            continue  # metadata and vendored shared libraries
        name = entry.name.split(".")[0]  # a package, a module or an extension module
        if any((site / name).exists() or any(site.glob(f"{name}.*")) for site in venv):
            clashes.append(name)
    if clashes:
        shutil.rmtree(target, ignore_errors=True)
        raise InstallError(f"would shadow venv packages: {', '.join(sorted(clashes))}")


def _write_standins(target: Path) -> None:
    """The kernel-free stand-in, as ``<target>/<kernel module>/__init__.py``."""
    for name in KERNEL_MODULES:
        if importlib.util.find_spec(name) is not None and name not in sys.modules:
            raise InstallError(f"a real {name} is importable from the venv; the tier stubs it")
        package = target / name
        package.mkdir(exist_ok=True)
        (package / "__init__.py").write_text(_STANDIN_SOURCE.read_text())


@contextlib.contextmanager
def _locked(path: Path):
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="append", help="SGLang version (repeatable)")
    parser.add_argument("--cache-dir", type=Path, default=CACHE_DIR)
    args = parser.parse_args()
    versions = tuple(args.version) if args.version else VERSIONS
    begin = time.monotonic()
    try:
        sites = ensure_installed(versions, args.cache_dir)
    except InstallError as error:
        print(f"sglang-conformance: {error}", file=sys.stderr)
        return 2
    total = sum(site.downloaded_mb for site in sites.values())
    print(
        f"sglang-conformance: ready: sglang {', '.join(versions)} in {args.cache_dir} "
        f"(downloaded {total:.1f} MB; {time.monotonic() - begin:.1f} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
