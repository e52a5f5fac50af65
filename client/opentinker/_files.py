"""Where downloads land. Every file is written to a temporary sibling and renamed into place,
so a target is either whole or untouched; nothing that exists is replaced unless the caller
asks (``overwrite``), and no directory is ever deleted except the temporary ones made here.
Local problems (a path under a file, no permission, a full disk) are ``UsageError`` naming
the path."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from .errors import OpenTinkerError, UsageError

FORCE = "--force (overwrite=True) replaces it"


def names_directory(path: str | Path) -> bool:
    """An existing directory, or a path written with a trailing separator (``ckpt/``)."""
    text = os.fspath(path)
    return text.endswith(("/", os.sep)) or Path(text).is_dir()


def _why(exc: OSError) -> str:
    return exc.strerror or str(exc)


def _umask() -> int:
    # The only portable way to read the umask is to set it and put it back.
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def ensure_directory(directory: Path) -> None:
    if directory.exists() and not directory.is_dir():
        raise UsageError(f"cannot write into {directory}: it exists and is not a directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create the directory {directory}: {_why(exc)}") from None


@contextmanager
def directory_for(directory: Path) -> Iterator[None]:
    """``directory``, made if it is missing; if the block fails, the directories made here are
    removed again while empty, so a failed download leaves no trace."""
    made = [p for p in (directory, *directory.parents) if not (p.is_symlink() or p.exists())]
    ensure_directory(directory)
    try:
        yield
    except BaseException:
        for path in made:  # innermost first
            try:
                path.rmdir()
            except OSError:
                break
        raise


def check_free(target: Path, overwrite: bool) -> None:
    """Refuse a target that exists, unless ``overwrite`` and it is a plain file (a device, a
    FIFO or a directory is never replaced: os.replace would swap it out from under its users)."""
    if not (target.is_symlink() or target.exists()):
        return
    if target.is_dir():
        raise UsageError(f"{target} is a directory; refusing to replace it")
    if not (target.is_symlink() or stat.S_ISREG(target.stat().st_mode)):
        raise UsageError(f"{target} exists and is not a regular file; refusing to replace it")
    if not overwrite:
        raise UsageError(f"{target} already exists; {FORCE}")


@contextmanager
def new_file(target: Path, *, overwrite: bool) -> Iterator[IO[bytes]]:
    """An open temporary file beside ``target``, renamed onto it when the block succeeds."""
    check_free(target, overwrite)
    with directory_for(target.parent):
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent)
        except OSError as exc:
            raise UsageError(f"cannot write {target}: {_why(exc)}") from None
        try:
            try:
                with os.fdopen(fd, "wb") as handle:
                    yield handle
                # mkstemp makes 0600; a download gets the mode any new file of the user gets.
                os.chmod(tmp, 0o666 & ~_umask())
                _publish(Path(tmp), target, overwrite)
            except OSError as exc:
                raise UsageError(f"cannot write {target}: {_why(exc)}") from None
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def _publish(tmp: Path, target: Path, overwrite: bool) -> None:
    if overwrite:
        os.replace(tmp, target)
        return
    # A hard link fails if the name was taken since check_free: never a silent overwrite.
    try:
        os.link(tmp, target)
    except FileExistsError:
        raise UsageError(f"{target} already exists; {FORCE}") from None
    except OSError:
        # A file system without hard links: the check above has to do.
        check_free(target, overwrite)
        os.replace(tmp, target)
    else:
        tmp.unlink()


@contextmanager
def scratch_file(directory: Path) -> Iterator[IO[bytes]]:
    """A temporary file in ``directory`` (for an archive to unpack), removed afterwards."""
    with directory_for(directory):
        try:
            with tempfile.TemporaryFile(dir=directory) as handle:
                yield handle
        except OSError as exc:
            raise UsageError(f"cannot write into {directory}: {_why(exc)}") from None


def check_directory_free(out: Path, overwrite: bool) -> None:
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise UsageError(f"{out} exists and is not a directory; refusing to replace it")
    if out.exists() and not overwrite:
        raise UsageError(f"{out} already exists; --force (overwrite=True) writes into it")


def unpack(archive: IO[bytes], out: Path, *, overwrite: bool, label: str) -> Path:
    """Unpack a zip into the directory ``out``: into a temporary sibling first, renamed into
    place; when ``out`` exists (``overwrite``), its files of the same names are replaced and
    every other file in it is left alone."""
    check_directory_free(out, overwrite)
    ensure_directory(out.parent)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    except OSError as exc:
        raise UsageError(f"cannot write into {out.parent}: {_why(exc)}") from None
    try:
        with zipfile.ZipFile(archive) as zf:
            for member in zf.namelist():
                # Never write outside the target directory, whatever the archive says.
                if member.startswith("/") or ".." in Path(member).parts:
                    raise OpenTinkerError(f"refusing unsafe path {member!r} in {label}")
            zf.extractall(tmp)
        # mkdtemp makes 0700; the directory gets the mode of any new directory of the user.
        os.chmod(tmp, 0o777 & ~_umask())
        if out.exists():
            _merge(tmp, out)
        else:
            os.rename(tmp, out)
    except OSError as exc:
        raise UsageError(f"cannot write {out}: {_why(exc)}") from None
    except zipfile.BadZipFile as exc:
        raise OpenTinkerError(f"{label} is not a valid zip archive: {exc}") from None
    finally:
        # Only ever the temporary directory made above (gone already after a rename).
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _merge(src: Path, dest: Path) -> None:
    for path in sorted(src.rglob("*")):
        target = dest / path.relative_to(src)
        if path.is_dir():
            ensure_directory(target)
        elif target.is_dir():
            raise UsageError(f"{target} is a directory; refusing to replace it with a file")
        else:
            os.replace(path, target)
