"""Read-only git plumbing for replaying a routine's history: the commits that touch its files, and a
commit's tree exported without a checkout (`git archive`: the user's work tree and index are never
touched, and a bare repository works).
"""
from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from harness.base.errors import UsageError


@dataclass
class Commit:
    sha: str
    subject: str
    date: str  # the author date: a rebase or a cherry-pick gives a branch's commits one committer date
    content: str  # the target files' blob ids: equal content, equal result
    same_as: str | None = None  # an earlier commit with the same content, whose result this one reuses

    @property
    def short(self) -> str:
        return self.sha[:10]


class Git:
    """Read-only access to a repository (a work tree's or a bare one)."""

    def __init__(self, repo: Path):
        found = subprocess.run(["git", "-C", str(repo), "rev-parse", "--absolute-git-dir"],
                               capture_output=True, text=True, timeout=60)
        if found.returncode:
            raise UsageError(f"{repo} is not a git repository: {found.stderr.strip()}")
        self.dir = found.stdout.strip()

    def __call__(self, *args: str) -> str:
        proc = subprocess.run(["git", "--git-dir", self.dir, *args], capture_output=True, text=True, timeout=300)
        if proc.returncode:
            raise UsageError(f"git {' '.join(args)}: {proc.stderr.strip()}")
        return proc.stdout

    def export(self, sha: str, dest: Path) -> list[str]:
        """The commit's tree into `dest`, through `git archive | tar` (no checkout, no index). A
        mirror may lack some blobs (large files left out of a snapshot): then the tree is written
        blob by blob, those left out; their paths are returned (none when the archive worked)."""
        archive = subprocess.Popen(["git", "--git-dir", self.dir, "archive", sha], stdout=subprocess.PIPE,
                                   stderr=subprocess.DEVNULL)
        assert archive.stdout is not None  # stdout=PIPE
        try:
            untar = subprocess.run(["tar", "-x", "-C", str(dest)], stdin=archive.stdout, capture_output=True,
                                   timeout=600)
        finally:
            archive.stdout.close()
            archive.wait(timeout=60)
        if archive.returncode == 0 and untar.returncode == 0:
            return []
        return self._export_blobs(sha, dest)

    def _export_blobs(self, sha: str, dest: Path) -> list[str]:
        entries = [line.split("\t", 1) for line in self("ls-tree", "-r", "-z", sha).split("\0") if line]
        blobs = [(meta.split(), path) for meta, path in entries if meta.split()[1] == "blob"]
        cat = subprocess.run(["git", "--git-dir", self.dir, "cat-file", "--batch"],
                             input="".join(f"{m[2]}\n" for m, _ in blobs).encode(), capture_output=True, timeout=600)
        out, pos, absent = cat.stdout, 0, []
        for (mode, _, _), path in blobs:
            end = out.index(b"\n", pos)
            header = out[pos:end].decode().split()
            pos = end + 1
            if header[-1] == "missing":
                absent.append(path)
                continue
            size = int(header[2])
            data, pos = out[pos:pos + size], pos + size + 1
            target = dest / path
            target.parent.mkdir(parents=True, exist_ok=True)
            if mode == "120000":
                target.unlink(missing_ok=True)
                target.symlink_to(data.decode())
            else:
                target.write_bytes(data)
                if mode == "100755":
                    target.chmod(0o755)
        return absent


def module_paths(git: Git, rev: str, module: str) -> list[str]:
    """The file that defines `module` at `rev` (a module file or a package's __init__.py)."""
    base = module.replace(".", "/")
    for path in (f"{base}.py", f"{base}/__init__.py"):
        if git("ls-tree", "--name-only", rev, "--", path).strip():
            return [path]
    raise UsageError(f"{module} is not in the repository at {rev} ({base}.py): give its files with --paths")


def commits(git: Git, paths: list[str], since: str | None, rev: str) -> list[Commit]:
    """The commits touching `paths` up to `rev`, oldest first, from `since` (included, whether it
    touches them or not: the starting point) when given; each marked with the earlier commit whose
    target files it repeats, if any."""
    fmt = "--format=%H%x00%as%x00%s"
    log = (git("log", "-1", fmt, since, "--") if since else "") + \
        git("log", "--reverse", fmt, f"{since}..{rev}" if since else rev, "--", *paths)
    out: list[Commit] = []
    seen: dict[str, str] = {}
    for line in log.splitlines():
        sha, date, subject = line.split("\0", 2)
        tree = git("ls-tree", sha, "--", *paths)
        content = " ".join(row.split()[2] for row in tree.splitlines())
        out.append(Commit(sha, subject, date, content, seen.get(content)))
        seen.setdefault(content, sha)
    return out
