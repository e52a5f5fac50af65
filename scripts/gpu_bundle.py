"""Packs what a lent GPU machine lacks to run scripts/gpu_check.sh into `.gpu/`.

A GPU machine lent for a short check starts bare, reaches no package index, and its image
holds PyTorch with CUDA and the Hugging Face stack but none of the service: no Django, Celery,
Valkey, gunicorn, openai or tinker. What travels with a call is the working tree plus the paths
it carries, 64 MiB in all, so the service's packages go as one xz archive of an installed
`--target` tree for the machine's Python (3.12), with their compiled libraries stripped:

    make gpu-bundle          # -> .gpu/site-cp312.tar.xz (~23 MB)

and a call carries `.gpu`; gpu_check.sh unpacks it when its Python cannot import Django.
Versions are this checkout's venv's (what the tests ran against), except for the packages the
image brings (IMAGE_HAS: torch, transformers, peft and the rest of the training stack), whose
CUDA builds could not travel anyway. `--python 3.11` builds one for this machine, to rehearse
the check on a venv that holds only the image's packages, in a folder of its own
(`--out var/gpu-rehearsal`, read by gpu_check.sh's GPU_BUNDLE_DIR; docs/verl.md).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
# Taken from the lent machines' image (as listed for it on 2026-11-17) rather than carried:
# the training stack (CUDA builds that could not travel) and the libraries it pins beside it,
# plus pytest and its own plugins' base. Everything else the service needs travels even where
# the image has some version of it (typing-extensions, httpx, click, ...), so that the
# service's packages run on the versions they were tested with.
IMAGE_HAS = frozenset(
    """accelerate filelock fsspec hf-xet huggingface-hub iniconfig jinja2 markupsafe mpmath
    networkx numpy peft pillow pluggy protobuf psutil pyarrow pytest pyyaml regex safetensors
    setuptools sympy tiktoken tokenizers torch tqdm transformers""".split()  # noqa: SIM905
)
# What the checks use beyond the service's own dependencies: the test runner's plugins and
# the clients the benchmarks drive.
EXTRA_ROOTS = ("pytest-django", "pytest-timeout", "tinker", "openai")
# Only for PostgreSQL, which the checks do not use (SQLite, as the README's path).
NOT_NEEDED = frozenset({"psycopg", "psycopg-binary"})
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
# The transfer limit of one device call, which the working tree shares with the bundle.
CALL_LIMIT = 64 * 2**20


def roots() -> list[str]:
    """The service's declared dependencies (pyproject.toml) and the checks' extras."""
    with (ROOT / "pyproject.toml").open("rb") as fh:
        project = tomllib.load(fh)["project"]
    return [*project["dependencies"], *EXTRA_ROOTS]


def requirements(root_specs: list[str]) -> dict[str, str]:
    """name -> version for every package the roots need (transitively, extras followed) that
    the image lacks, at the versions installed in this interpreter's environment."""
    pinned: dict[str, str] = {}
    seen: set[tuple[str, tuple[str, ...]]] = set()
    stack = [Requirement(spec) for spec in root_specs]
    while stack:
        req = stack.pop()
        name = canonicalize_name(req.name)
        key = (name, tuple(sorted(req.extras)))
        if key in seen or name in NOT_NEEDED:
            continue
        seen.add(key)
        in_image = name in IMAGE_HAS
        if in_image and not req.extras:
            continue
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            raise SystemExit(
                f"{req.name} is not installed here: run `make install` first, so that the "
                "bundle holds the versions the tests ran against"
            ) from None
        if not in_image:
            pinned[name] = dist.version
        # A package the image holds still needs what an extra asks of it (httpx[http2]: h2).
        wanted = sorted(req.extras) if in_image else ["", *sorted(req.extras)]
        for raw in dist.requires or ():
            dep = Requirement(raw)
            if dep.marker is None:
                if not in_image:
                    stack.append(dep)
            elif any(dep.marker.evaluate({"extra": e}) for e in wanted):
                stack.append(dep)
    return dict(sorted(pinned.items()))


def tree_bytes() -> int:
    """Bytes of what a device call sends besides carried paths: tracked and untracked files
    that git does not ignore."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    paths = [ROOT / p.decode() for p in listed if p]
    return sum(path.stat().st_size for path in paths if path.is_file())


def build(python: str, out: Path, pins: dict[str, str]) -> Path:
    tag = "cp" + python.replace(".", "")
    target_flags = ["--only-binary=:all:", "--python-version", python, "--implementation", "cp"]
    for platform in PLATFORMS:
        target_flags += ["--platform", platform]
    specs = [f"{name}=={version}" for name, version in pins.items()]
    with tempfile.TemporaryDirectory(prefix="gpu-bundle-") as tmp:
        wheels, site = Path(tmp) / "wheels", Path(tmp) / "site"
        pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
        subprocess.run(
            [*pip, "download", "--no-deps", *target_flags, "-d", str(wheels), *specs], check=True
        )
        subprocess.run(
            [
                *pip,
                "install",
                "--no-deps",
                "--no-index",
                "--no-compile",
                *target_flags,
                "--target",
                str(site),
                *map(str, sorted(wheels.glob("*.whl"))),
            ],
            check=True,
        )
        for pycache in site.rglob("__pycache__"):
            shutil.rmtree(pycache, ignore_errors=True)
        if shutil.which("strip"):
            # Debug symbols are most of some extensions' size (zstandard, cryptography).
            for lib in site.rglob("*.so*"):
                if lib.is_file():
                    subprocess.run(["strip", "--strip-unneeded", str(lib)], check=False)
        out.mkdir(parents=True, exist_ok=True)
        archive = out / f"site-{tag}.tar.xz"
        partial = archive.with_suffix(".partial")
        with tarfile.open(partial, "w:xz", preset=9) as tar:
            tar.add(site, arcname=".")
        partial.replace(archive)
        (out / f"site-{tag}.txt").write_text("".join(f"{s}\n" for s in specs))
    return archive


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default="3.12", help="the lent machine's Python (3.12)")
    parser.add_argument("--out", type=Path, default=ROOT / ".gpu")
    parser.add_argument("--list", action="store_true", help="print the pinned packages only")
    args = parser.parse_args()
    if not re.fullmatch(r"3\.\d+", args.python):
        parser.error(f"--python: expected a version such as 3.12, got {args.python!r}")
    pins = requirements(roots())
    if args.list:
        print("\n".join(f"{name}=={version}" for name, version in pins.items()))
        return
    archive = build(args.python, args.out, pins)
    # Everything in the folder travels when a call carries it, earlier bundles included.
    carried = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    tree = tree_bytes()
    print(
        f"{archive}: {len(pins)} packages, {archive.stat().st_size / 1e6:.1f} MB; "
        f"{args.out} ({carried / 1e6:.1f} MB) with the working tree ({tree / 1e6:.1f} MB): "
        f"{(carried + tree) / 2**20:.1f} of a device call's 64 MiB"
    )
    if carried + tree > CALL_LIMIT:
        raise SystemExit(
            f"too large for one device call: {args.out} and the working tree exceed 64 MiB"
        )


if __name__ == "__main__":
    main()
