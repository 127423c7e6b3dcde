"""Secrets kept in files readable by this user only: Ray's cluster token and the HTTP API key.

- ``state_dir()``: ``$XDG_STATE_HOME/specserve``, else ``~/.local/state/specserve``.
- ``ray_token_path()``: where ``specserve serve`` keeps the token of the local Ray cluster.
- ``ensure_token_file(path)``: the token file, generated once (256 random bits, mode 0600, directory
  0700) and reused by every later launch; an existing file that another user owns or can read, or
  that is empty, is refused rather than used.
- ``read_secret_file(path, where)``: a secret's text without its trailing newline; ``SecretFileError``
  (a ``ValueError``) starting with ``where`` if the file is missing, unreadable or empty.
- ``private_copy(text, name)``: ``text`` in a fresh 0600 file inside a fresh 0700 temporary directory
  (the caller removes the directory).

No ray import (Ray reads the token itself, from ``RAY_AUTH_TOKEN_PATH``), and no project import: the
config module uses this one.
"""

from __future__ import annotations

import os
import secrets
import stat
import tempfile
from pathlib import Path

TOKEN_BYTES = 32  # 256 bits, as `ray get-auth-token --generate`


class SecretFileError(ValueError):
    """A secret file that cannot be used; the message starts with what it is for."""


def state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or ""
    # The XDG spec ignores relative values: they would resolve against whatever the working directory is.
    root = Path(base) if os.path.isabs(base) else Path.home() / ".local" / "state"
    return root / "specserve"


def ray_token_path() -> Path:
    return state_dir() / "ray_token"


def ensure_token_file(path: Path) -> Path:
    """Create ``path`` with a new random token unless it exists; check an existing one. Returns ``path``."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not path.exists():
        # Written under a temporary name and linked into place: two launches racing never read a half-written
        # token, and the one that loses keeps the winner's.
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".token-")  # mode 0600
        try:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(TOKEN_BYTES))  # no newline, like `ray get-auth-token --generate`
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass
        finally:
            os.unlink(tmp)
    st = path.stat()
    if st.st_uid != os.getuid() or st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SecretFileError(f"Ray token file {path}: must belong to this user and be private to it (it is mode "
                              f"{stat.filemode(st.st_mode)}, owner uid {st.st_uid}); `chmod 600` it, or delete "
                              "it to have a new token generated")
    read_secret_file(path, "Ray token file")
    return path


def read_secret_file(path: str | os.PathLike[str], where: str) -> str:
    file = Path(path).expanduser()
    try:
        text = file.read_text(encoding="utf-8").rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as e:
        raise SecretFileError(f"{where}: cannot read {file}: {e}") from e
    if not text.strip():
        raise SecretFileError(f"{where}: {file} is empty")
    return text


def private_copy(text: str, name: str) -> Path:
    folder = Path(tempfile.mkdtemp(prefix="specserve-"))  # mode 0700
    file = folder / name
    fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    return file
