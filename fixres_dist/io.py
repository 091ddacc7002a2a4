"""Files a run writes and reads: one atomic, owner-only writer and one safe loader.

:func:`write_private` (and :func:`write_private_by_name`, for a writer that opens the file itself)
is the only way this package writes a result file: the content goes to a temporary file in the same
folder (mode 0600), is fsynced, renamed over the target and the folder is fsynced, so a reader sees
the complete old or the complete new file, never a partial one, whatever stops the writer.
:func:`safe_load` reads PyTorch files with ``weights_only=True``: nothing in them is executed, and
every failure is one :class:`FixresError` line.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import pwd
import socket
import stat
import warnings
from pathlib import Path
from typing import BinaryIO, Callable

import torch

from fixres_dist.errors import FixresError

TEMP_SUFFIX = ".tmp"


def temporary_name(path: Path) -> Path:
    """The hidden temporary sibling of ``path`` that :func:`write_private` writes first; named after
    this host and process, so that writers on several machines of a shared folder (two jobs
    indexing the same data) never share one."""
    return path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}{TEMP_SUFFIX}")


def fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _replacing(path: Path):
    """The temporary sibling of ``path`` to fill in the block; renamed over ``path`` when the block ends,
    removed when it raises (then ``path`` is left as it was); the folder fsynced after the rename."""
    tmp = temporary_name(path)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_folder(path.parent)


def write_private(path: str | Path, content: str | bytes | Callable[[BinaryIO], None], mode: int = 0o600) -> Path:
    """Write ``content`` to ``path`` atomically, readable by the owner only; returns ``path``.

    ``content`` is text (UTF-8), bytes, or a function that writes into the open binary file (e.g.
    ``lambda f: torch.save(state, f)``). ``mode``: another mode for a file meant to be shared (packed
    data: 0o644, less the umask). Raises ``OSError`` (full or read-only disk) after removing the
    temporary file; the previous ``path``, if any, is left as it was.
    """
    path = Path(path)
    with _replacing(path) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "wb") as f:
            if callable(content):
                content(f)
            else:
                f.write(content.encode() if isinstance(content, str) else content)
            f.flush()
            os.fsync(f.fileno())
    return path


def write_private_by_name(path: str | Path, writer: Callable[[Path], None]) -> Path:
    """:func:`write_private` for a ``writer`` that opens the file itself by its name
    (``torch.profiler``'s trace export): ``writer(name)`` writes the temporary file ``name``, made 0600
    before and after it (a writer's own open keeps the mode; one that replaces the file does not),
    which is then fsynced and renamed to ``path``. Raises ``OSError`` as :func:`write_private` does,
    the temporary file removed."""
    path = Path(path)
    with _replacing(path) as tmp:
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
        writer(tmp)
        os.chmod(tmp, 0o600)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)  # a write the disk refused late (delayed allocation, NFS) is an OSError here
        finally:
            os.close(fd)
    return path


def remove_stale_temporaries(folder: Path, pattern: str = "*") -> None:
    """Delete temporary files a killed writer left in ``folder`` (names from :func:`temporary_name`)."""
    for stale in Path(folder).glob(f".{pattern}{TEMP_SUFFIX}"):
        stale.unlink(missing_ok=True)


def _make_private(path: str, mask: int) -> None:
    """Take away what ``mask`` does not allow from ``path``'s mode if this user owns it (not links;
    an entry removed meanwhile, such as a rank's temporary file, is no error)."""
    try:
        status = os.lstat(path)
        if stat.S_IMODE(status.st_mode) & ~mask and status.st_uid == os.geteuid() and not stat.S_ISLNK(status.st_mode):
            os.chmod(path, stat.S_IMODE(status.st_mode) & mask)
    except FileNotFoundError:
        pass


def private_folder(folder: Path) -> None:
    """Create ``folder`` (and parents) and make it owner-only, with everything already in it (files
    0600, folders 0700: what an older version or a loose umask left behind); parents it creates are
    never writable by others. Entries of other users are left as they are. Raises OSError."""
    created = [p for p in Path(folder).absolute().parents if not p.exists()]
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(folder, 0o700)
    for parent in created:  # e.g. the shared folder, whatever the umask
        _make_private(str(parent), 0o755)
    for parent, folders, files in os.walk(folder):
        for name, mode in [*((f, 0o700) for f in folders), *((f, 0o600) for f in files)]:
            _make_private(os.path.join(parent, name), mode)


def owner_name(uid: int) -> str:
    """``name (uid N)``, or ``uid N`` for a uid without a user name, for messages."""
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def check_own_job_folder(folder: Path) -> None:
    """Refuse an existing job ``folder`` that another user owns (root's run included: it would take
    over that user's job). Raises :class:`FixresError` naming the owner and what to do."""
    try:
        owner = Path(folder).stat().st_uid
    except OSError:  # none there (or a file above it): nobody's, and the caller's own checks say why
        return
    if owner != os.geteuid():
        raise FixresError(f"job folder {folder} belongs to {owner_name(owner)}, not to {owner_name(os.geteuid())}: "
                          "it is another user's job; use another --job-id or your own --shared-folder-path")


def make_private_folder(folder: Path) -> None:
    """:func:`private_folder` for a job folder; FixresError if it cannot be made or used, or belongs to
    another user (:func:`check_own_job_folder`)."""
    check_own_job_folder(folder)
    try:
        private_folder(folder)
    except OSError as exc:
        raise FixresError(f"cannot use job folder {folder}: {exc.strerror or exc}") from None


def safe_load(path: str | Path, what: str):
    """``torch.load(path, weights_only=True)`` with one-line FixresErrors; never runs code from the file.
    The file is memory-mapped (``mmap=True``: a tensor's bytes are read when first used, into pages the
    processes of a node share and the kernel can drop), but for the legacy format (before torch 1.6),
    which is read whole."""
    path = Path(path)
    if not path.exists():
        raise FixresError(f"{what} {path} does not exist")
    if not path.is_file():
        raise FixresError(f"{what} {path} is not a file")
    if path.stat().st_size == 0:
        raise FixresError(f"{what} {path} is empty (0 bytes)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as exc:
                if "mmap can only be used" not in str(exc):
                    raise
                return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise FixresError(f"refused {what} {path}: it holds Python objects other than tensors and plain "
                          "data (not loaded; nothing in it was executed)") from None
    except Exception as exc:  # torch raises many types for corrupt files; we report them all the same way
        raise FixresError(f"cannot read {what} {path}: not a complete PyTorch file ({type(exc).__name__}; "
                          "truncated or corrupt?)") from None
