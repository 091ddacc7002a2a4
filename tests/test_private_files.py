"""Owner-only means every file: whatever a run writes in its job folder is 0600, every folder 0700,
whatever the umask; another user's job folder is refused, naming its owner."""
from __future__ import annotations

import os
import pwd
import re
import shutil
import stat

import pytest

from conftest import SCRATCH, run_main, run_script
from fixres_dist import io
from fixres_dist.errors import FixresError


@pytest.fixture
def umask_022():
    """The common default umask (group and others may read new files), set explicitly."""
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def test_every_file_of_a_two_rank_run_with_a_sweep_is_owner_only(umask_022, few_data, tmp_path):
    result = run_script("scratch", "--num-tasks", 2, "--job-id", "private", "--shared-folder-path", tmp_path,
                        "--data-path", few_data, "--architecture", "resnet20", "--input-size", 16, "--test-sizes",
                        "16,24", "--keep-checkpoints", 2, "--batch", 4, "--epochs", 1, "--workers", 0, "--no-progress")
    assert result.returncode == 0, result.stderr[-3000:]
    folder = tmp_path / "private"
    written = {p.name for p in folder.iterdir()}
    assert {".lock", "config.json", "metrics.jsonl", "checkpoint.pth", "resolution_sweep.png",
            "resolution_sweep.md"} <= written
    modes = {str(path.relative_to(tmp_path)): stat.S_IMODE(path.lstat().st_mode)
             for path in [folder, *folder.rglob("*")]}
    assert modes == {name: 0o700 if (tmp_path / name).is_dir() else 0o600 for name in modes}


def test_a_rerun_makes_what_an_older_run_left_readable_to_others_owner_only(scratch_job, tiny_data, tmp_path):
    """Files of an older version, or of a run under a loose umask, are tightened when the job folder
    is opened again (here: a copy of the session's finished job, whose rerun trains nothing)."""
    folder = tmp_path / scratch_job.name
    shutil.copytree(scratch_job, folder)
    (folder / "notes").mkdir()
    (folder / "notes" / "mine.txt").write_text("")
    for path in [folder, *folder.rglob("*")]:
        path.chmod(0o777 if path.is_dir() else 0o666)
    rerun = run_script("scratch", "--num-tasks", 2, "--job-id", scratch_job.name, "--shared-folder-path", tmp_path,
                       "--data-path", tiny_data, *SCRATCH)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    modes = {path.name: stat.S_IMODE(path.lstat().st_mode) for path in [folder, *folder.rglob("*")]}
    assert modes == {path.name: 0o700 if path.is_dir() else 0o600 for path in [folder, *folder.rglob("*")]}


def unnamed_uid() -> int:
    return next(uid for uid in range(40000, 50000) if uid not in {user.pw_uid for user in pwd.getpwall()})


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root (chown)")
@pytest.mark.parametrize("uid", [65534, unnamed_uid()])
def test_another_users_job_folder_is_refused_naming_its_owner(tmp_path, tiny_data, capsys, uid):
    """Root's run included (it could use the folder): the line names the owner, by name or by uid."""
    folder = tmp_path / "theirs"
    folder.mkdir(mode=0o700)
    (folder / "checkpoint.pth").write_bytes(b"their work")
    os.chown(folder, uid, uid)
    try:
        owner = f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        owner = f"uid {uid}"
    me = f"{pwd.getpwuid(os.geteuid()).pw_name} (uid {os.geteuid()})"
    line = (f"job folder {folder} belongs to {owner}, not to {me}: it is another user's job; use another --job-id or "
            "your own --shared-folder-path")
    status, err = run_main(capsys, "scratch", "--job-id", "theirs", "--shared-folder-path", tmp_path, "--data-path",
                           tiny_data, *SCRATCH)
    assert status == 1 and err == f"fixres_dist: rank 0: {line}\n", err
    with pytest.raises(FixresError, match=f"^{re.escape(line)}$"):  # a rank started by hand, past the preflight
        io.make_private_folder(folder)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["theirs"]  # nothing written, the file index included
    assert os.listdir(folder) == ["checkpoint.pth"] and (folder / "checkpoint.pth").read_bytes() == b"their work"
    assert folder.stat().st_uid == uid and stat.S_IMODE(folder.stat().st_mode) == 0o700
