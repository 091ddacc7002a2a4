"""A real filesystem that fails as a network filesystem does: ``flock`` refused with ENOLCK (NFS without
its lock daemon), and reads of chosen files that never return (a hung server).

``python tests/hung_fs.py MOUNTPOINT [NAME...]`` (root: it mounts) serves an in-memory FUSE filesystem
at MOUNTPOINT, speaking the kernel's FUSE protocol on ``/dev/fuse`` itself (no libfuse), prints
``mounted`` and serves until it is unmounted. Files and folders behave as on any filesystem; it
advertises flock support, and answers every lock request (``flock``, ``fcntl`` locks) with ENOLCK,
so that the kernel's ``flock(2)`` fails with ENOLCK exactly where an NFS mount without ``lockd`` would.
A read of a file named one of the NAMEs is never answered: the reader waits in the kernel, as on a hard
NFS mount whose server stopped answering (a fatal signal still ends it).

:func:`mounted` runs it for a test and unmounts it after, or skips the test with the reason where it
cannot be mounted (not root, no ``/dev/fuse``).
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
import struct
import subprocess
import sys
import time
from pathlib import Path

IN_HEADER = struct.Struct("<IIQQIIIHH")
OUT_HEADER = struct.Struct("<IiQ")
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")
ENTRY = struct.Struct("<QQQQII")
OPEN_OUT = struct.Struct("<QIi")
RW_IN = struct.Struct("<QQIIQII")
SETATTR_IN = struct.Struct("<IIQQQQQQIIIIIIII")
FLOCK_LOCKS, BIG_WRITES = 1 << 10, 1 << 5
MAX_WRITE = 1 << 17
ROOT = 1
(LOOKUP, FORGET, GETATTR, SETATTR, MKDIR, UNLINK, RMDIR, RENAME, OPEN, READ, WRITE, STATFS, RELEASE, FSYNC,
 FLUSH, INIT, OPENDIR, READDIR, RELEASEDIR, FSYNCDIR, GETLK, SETLK, SETLKW, CREATE, INTERRUPT, BATCH_FORGET) = (
    1, 2, 3, 4, 9, 10, 11, 12, 14, 15, 16, 17, 18, 20, 25, 26, 27, 28, 29, 30, 31, 32, 33, 35, 36, 42)
NO_REPLY = {FORGET, INTERRUPT, BATCH_FORGET}


class Node:
    def __init__(self, number: int, mode: int, uid: int, gid: int):
        self.number, self.mode, self.uid, self.gid = number, mode, uid, gid
        self.data, self.children = bytearray(), {}
        self.mtime = time.time_ns()
        self.hangs = False  # a read of it is never answered

    def attr(self) -> bytes:
        seconds, nanoseconds = divmod(self.mtime, 10 ** 9)
        size = len(self.data)
        return ATTR.pack(self.number, size, (size + 511) // 512, seconds, seconds, seconds, nanoseconds, nanoseconds,
                         nanoseconds, self.mode, 2 if stat.S_ISDIR(self.mode) else 1, self.uid, self.gid, 0, 4096, 0)


class HungFilesystem:
    def __init__(self, hung: tuple[str, ...] = ()):
        self.nodes = {ROOT: Node(ROOT, stat.S_IFDIR | 0o755, os.getuid(), os.getgid())}
        self.next = ROOT + 1
        self.hung = set(hung)  # reads of files of these names are never answered

    def entry(self, node: Node) -> bytes:
        return ENTRY.pack(node.number, 0, 0, 0, 0, 0) + node.attr()

    def make(self, parent: Node, name: str, mode: int, uid: int, gid: int) -> Node:
        node = self.nodes[self.next] = Node(self.next, mode, uid, gid)
        self.next += 1
        parent.children[name] = node.number
        node.hangs = name in self.hung
        return node

    def handle(self, opcode: int, node: Node, uid: int, gid: int, body: bytes) -> bytes | int | None:
        """The reply's body, a positive errno, or None for no reply (a hung read)."""
        name = body.split(b"\0")[0].decode(errors="surrogateescape")
        if opcode == INIT:
            major, minor, readahead, _ = struct.unpack_from("<IIII", body)
            return struct.pack("<IIIIHHIIHHII", 7, 31, readahead, FLOCK_LOCKS | BIG_WRITES, 16, 12, MAX_WRITE, 1,
                               32, 0, 0, 0).ljust(64, b"\0")
        if opcode in (GETLK, SETLK, SETLKW):
            return errno.ENOLCK  # the point of this filesystem: no lock can be taken
        if opcode == LOOKUP:
            number = node.children.get(name)
            return errno.ENOENT if number is None else self.entry(self.nodes[number])
        if opcode in (GETATTR, SETATTR):
            if opcode == SETATTR:
                valid, _, _, size, _, _, mtime, _, _, mtimensec, _, mode, _, owner, group, _ = SETATTR_IN.unpack_from(
                    body)
                if valid & 1:
                    node.mode = stat.S_IFMT(node.mode) | (mode & 0o7777)
                if valid & 2:
                    node.uid = owner
                if valid & 4:
                    node.gid = group
                if valid & 8:
                    node.data[size:] = b""
                    node.data.extend(bytes(size - len(node.data)))
                if valid & 32:
                    node.mtime = mtime * 10 ** 9 + mtimensec
            return struct.pack("<QII", 0, 0, 0) + node.attr()
        if opcode in (MKDIR, CREATE):
            mode, *_ = struct.unpack_from("<I", body)
            rest = body[8 if opcode == MKDIR else 16:]
            name = rest.split(b"\0")[0].decode(errors="surrogateescape")
            if name in node.children:
                return errno.EEXIST
            kind = stat.S_IFDIR if opcode == MKDIR else stat.S_IFREG
            made = self.make(node, name, kind | (mode & 0o7777), uid, gid)
            return self.entry(made) + (OPEN_OUT.pack(0, 0, 0) if opcode == CREATE else b"")
        if opcode in (UNLINK, RMDIR):
            number = node.children.get(name)
            if number is None:
                return errno.ENOENT
            if opcode == RMDIR and self.nodes[number].children:
                return errno.ENOTEMPTY
            del node.children[name]
            return b""
        if opcode == RENAME:
            (new_parent,) = struct.unpack_from("<Q", body)
            old, new = body[8:].split(b"\0")[:2]
            number = node.children.pop(old.decode(errors="surrogateescape"), None)
            if number is None:
                return errno.ENOENT
            self.nodes[new_parent].children[new.decode(errors="surrogateescape")] = number
            return b""
        if opcode in (OPEN, OPENDIR):
            return OPEN_OUT.pack(0, 0, 0)
        if opcode == READ:
            if node.hangs:
                return None  # never answered: the reader waits
            _, offset, size, *_ = RW_IN.unpack_from(body)
            return bytes(node.data[offset:offset + size])
        if opcode == WRITE:
            _, offset, size, *_ = RW_IN.unpack_from(body)
            data = body[RW_IN.size:RW_IN.size + size]
            if offset > len(node.data):
                node.data.extend(bytes(offset - len(node.data)))
            node.data[offset:offset + size] = data
            node.mtime = time.time_ns()
            return struct.pack("<II", size, 0)
        if opcode == READDIR:
            _, offset, size, *_ = RW_IN.unpack_from(body)
            entries = [(".", node.number, node.mode), ("..", node.number, node.mode),
                       *((n, number, self.nodes[number].mode) for n, number in node.children.items())]
            out = b""
            for position, (entry_name, number, mode) in enumerate(entries[offset:], offset + 1):
                encoded = entry_name.encode(errors="surrogateescape")
                record = struct.pack("<QQII", number, position, len(encoded), stat.S_IFMT(mode) >> 12) + encoded
                record += bytes(-len(record) % 8)
                if len(out) + len(record) > size:
                    break
                out += record
            return out
        if opcode == STATFS:
            return struct.pack("<QQQQQIIII", 1 << 20, 1 << 19, 1 << 19, 1 << 16, 1 << 15, 4096, 255, 4096, 0) + \
                bytes(24)
        if opcode in (RELEASE, RELEASEDIR, FLUSH, FSYNC, FSYNCDIR):
            return b""
        return errno.ENOSYS

    def serve(self, device: int) -> None:
        while True:
            try:
                request = os.read(device, MAX_WRITE + 4096)
            except OSError as exc:
                if exc.errno == errno.ENODEV:  # unmounted
                    return
                if exc.errno in (errno.EINTR, errno.ENOENT):  # an interrupted request
                    continue
                raise
            _, opcode, unique, number, uid, gid, *_ = IN_HEADER.unpack_from(request)
            if opcode in NO_REPLY:
                continue
            node = self.nodes.get(ROOT if opcode == INIT else number)  # INIT names no node
            reply = errno.ENOENT if node is None else self.handle(opcode, node, uid, gid, request[IN_HEADER.size:])
            if reply is None:
                continue
            if isinstance(reply, int):
                message = OUT_HEADER.pack(OUT_HEADER.size, -reply, unique)
            else:
                message = OUT_HEADER.pack(OUT_HEADER.size + len(reply), 0, unique) + reply
            try:
                os.write(device, message)
            except OSError as exc:
                if exc.errno != errno.ENOENT:  # the request was interrupted meanwhile
                    raise


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def mount(mountpoint: str) -> int:
    """Open ``/dev/fuse`` and mount it at ``mountpoint``; returns the device's descriptor. Raises OSError."""
    device = os.open("/dev/fuse", os.O_RDWR)
    options = f"fd={device},rootmode=40000,user_id={os.getuid()},group_id={os.getgid()}".encode()
    if _libc().mount(b"hungfs", mountpoint.encode(), b"fuse", 6, options) != 0:  # MS_NOSUID | MS_NODEV
        code = ctypes.get_errno()
        os.close(device)
        raise OSError(code, os.strerror(code), mountpoint)
    return device


def unmount(mountpoint: Path) -> None:
    _libc().umount2(str(mountpoint).encode(), 2)  # MNT_DETACH


@contextlib.contextmanager
def mounted(mountpoint: Path, hung: tuple[str, ...] = ()):
    """The filesystem served at ``mountpoint`` (made if need be) by a child process while the block runs,
    reads of files named in ``hung`` never answered; skips the calling test, saying why, where it cannot be
    mounted."""
    import pytest

    mountpoint.mkdir(parents=True, exist_ok=True)
    server = subprocess.Popen([sys.executable, __file__, str(mountpoint), *hung], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    ready = server.stdout.readline().strip()
    if ready != "mounted":
        server.wait(10)
        why = server.stderr.read().strip()
        pytest.skip(f"cannot mount a FUSE filesystem here (root and /dev/fuse are needed): {why}")
    try:
        yield mountpoint
    finally:
        unmount(mountpoint)
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:  # a reader still waits on a hung read: the server goes anyway
            server.kill()
            server.wait()


if __name__ == "__main__":
    try:
        fd = mount(sys.argv[1])
    except OSError as exc:
        print(f"cannot mount {sys.argv[1]}: {exc.strerror}", file=sys.stderr)
        raise SystemExit(1) from None
    print("mounted", flush=True)
    HungFilesystem(tuple(sys.argv[2:])).serve(fd)
