"""Checkpoints of the local policy model, addressed by (family, revision) and verified by SHA-256.

    ref = save_checkpoint(model, "ckpt/", family="tiny", revision=3)   # CheckpointRef(uri, digest)
    model = load_checkpoint(ref)        # refuses a file whose bytes do not hash to ref.digest
    model = load_checkpoint(ref.uri)    # a bare path (ckpt/tiny-r000003-<digest[:12]>.pt): loaded, not verified

The file is a ``torch.save`` of ``{"format": 1, "family", "revision", "config", "state_dict"}``;
the digest is of the file's bytes exactly as written. Its name is ``checkpoint_filename(family, revision, digest)``:
the family's ``schemas.policy.family_slug`` (``org/name`` -> ``org--name``), so a family named as Hugging Face
names models is one file in ``directory``, never a sub-folder; the family inside the file is the family itself.

torch is imported only where a file is written or read: naming and hashing one (a vLLM arena's swap, the packaged
model's lookup before vLLM is spawned) need none, and its import is about a second on 2 cores.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse

from schemas.errors import ContractError
from schemas.policy import CheckpointRef, family_slug

if TYPE_CHECKING:
    from policy.model import PolicyModel

FORMAT = 1


class CheckpointDigestError(ContractError):
    """The checkpoint's bytes do not hash to the digest its reference names."""


def checkpoint_stem(family: str, revision: int) -> str:
    """``<family_slug>-r<revision:06d>``: the name of a revision's checkpoint, without its extension (the tiny
    model adds ``.pt``, an HF model's folder is this name), for every kind of checkpoint."""
    return f"{family_slug(family)}-r{int(revision):06d}"


def checkpoint_name(family: str, revision: int, digest: str) -> str:
    """``<checkpoint_stem>-<digest[:12]>``: a checkpoint is named by its content, so a name never changes meaning.
    Two trainers that wrote revision N differently (a fenced one and its successor, sharing a volume) write two
    names, and neither overwrites the one the committed revision names."""
    return f"{checkpoint_stem(family, revision)}-{digest[:12]}"


def checkpoint_filename(family: str, revision: int, digest: str) -> str:
    return checkpoint_name(family, revision, digest) + ".pt"


def fsync_tree(path: Path) -> None:
    """Flush a file, or every file of a folder, and the folder entries naming them, to the disk: what the trainer
    writes before the Kafka commit that names it must outlive a machine crash, not just a process crash."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    folders = {p.parent for p in files} | ({path} if path.is_dir() else set())
    for p in files:
        with open(p, "rb") as f:
            os.fsync(f.fileno())
    for d in folders:
        fsync_dir(d)


def fsync_dir(folder: Path) -> None:
    """Flush a folder's entries (a rename into it) to the disk."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def digest_flushing(tmp: Path, file: Path) -> str:
    """The sha256 of ``file`` (within ``tmp``), hashed while ``tmp`` is flushed to the disk (``fsync_tree``): the
    hash reads the page cache while the flush waits on the disk, so a publish pays the longer of the two, not
    both. ``place`` it with ``flushed=True``."""
    with ThreadPoolExecutor(1, thread_name_prefix="fsync") as pool:
        flushing = pool.submit(fsync_tree, tmp)
        digest = file_sha256(file)
        flushing.result()
    return digest


def place(tmp: Path, final: Path, *, flushed: bool = False) -> Path:
    """Move a fully written checkpoint (file or folder) to its content-addressed name, durably (``fsync_tree``
    unless it is ``flushed`` already, then the directory holding the name); one already there holds the same
    bytes (the digest names it), and is kept."""
    if not flushed:
        fsync_tree(tmp)
    try:
        if final.exists():
            raise FileExistsError(final)
        os.replace(tmp, final)
    except OSError:  # there already (a folder cannot be replaced): the same content
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
    fsync_dir(final.parent)
    return final


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


FULL_BELOW_BYTES = 1 << 20  # a filesystem with less room than this after a failed write was full


@contextmanager
def writing(folder: Path, tmp: Path) -> Iterator[None]:
    """A checkpoint write into ``tmp`` (in ``folder``). A full disk raises ``OSError(ENOSPC)`` whatever the library
    writing said (``torch.save`` raises RuntimeError "unexpected pos", safetensors its own error), so the service
    waits it out as the environment's fault (``streams.transactions.environment_fault``) instead of dead-lettering
    the batch; the partial write is removed, so it holds no room."""
    try:
        yield
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
        if not isinstance(e, OSError) and isinstance(e, Exception) and _full(folder, e):
            raise OSError(errno.ENOSPC, f"No space left on device writing {tmp.name} in {folder} ({e})") from e
        raise


def _full(folder: Path, e: Exception) -> bool:
    if "os error 28" in str(e) or "No space left" in str(e):
        return True
    try:
        st = os.statvfs(folder)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < FULL_BELOW_BYTES


def save_checkpoint(model: PolicyModel, directory: str | os.PathLike, family: str, revision: int) -> CheckpointRef:
    """Write atomically (temp file + rename to its content-addressed name) and return the reference with the
    file's SHA-256."""
    import torch

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f"{checkpoint_stem(family, revision)}.tmp{os.getpid()}"
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    with writing(d, tmp):
        torch.save({"format": FORMAT, "family": family, "revision": int(revision),
                    "config": model.config.to_dict(), "state_dict": state}, tmp)
    digest = digest_flushing(tmp, tmp)
    path = place(tmp, d / checkpoint_filename(family, revision, digest), flushed=True)
    return CheckpointRef(uri=path.resolve().as_uri(), digest=digest)


def checkpoint_path(ref_or_path: CheckpointRef | str | os.PathLike) -> Path:
    uri = ref_or_path.uri if isinstance(ref_or_path, CheckpointRef) else os.fspath(ref_or_path)
    if uri.startswith("file://"):
        return Path(unquote(urlparse(uri).path))  # Path.as_uri() percent-encodes (a space, a %, non-ASCII)
    if "://" in uri:
        raise ValueError(f"only local file checkpoints are supported, got {uri!r}")
    return Path(uri)


def load_checkpoint_info(ref_or_path: CheckpointRef | str | os.PathLike) -> tuple[PolicyModel, dict]:
    """(model, {"family", "revision", "digest"}); verifies the digest when given a CheckpointRef."""
    import torch

    from policy.model import ModelConfig, PolicyModel

    path = checkpoint_path(ref_or_path)
    digest = file_sha256(path)
    if isinstance(ref_or_path, CheckpointRef) and digest != ref_or_path.digest:
        raise CheckpointDigestError(f"checkpoint {path} has sha256 {digest}, but its reference says "
                                    f"{ref_or_path.digest}: refusing to load different weights")
    blob = torch.load(path, map_location="cpu", weights_only=True)
    if blob.get("format") != FORMAT:
        raise ContractError(f"checkpoint {path} has format {blob.get('format')!r}, expected {FORMAT}")
    model = PolicyModel(ModelConfig(**blob["config"]))
    model.load_state_dict(blob["state_dict"])
    model.eval()
    return model, {"family": blob["family"], "revision": blob["revision"], "digest": digest}


def load_checkpoint(ref_or_path: CheckpointRef | str | os.PathLike) -> PolicyModel:
    return load_checkpoint_info(ref_or_path)[0]
