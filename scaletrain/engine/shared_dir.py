"""Before the first step: does every host see the same run directory?

Checkpoints are written by every rank into one directory and read back by rank 0 (the index, the rename,
``latest``); on a directory that is local to each host, every host would hold a part and none a whole
checkpoint. So rank 0 writes a token file with random content in the run directory (or, while it does not
exist yet, in its nearest existing parent, so that nothing is created), every rank reads it, the results are
gathered, and rank 0 removes the token. Any rank that does not read the same content stops the job with one
line naming its host(s), exit 2, before anything is written.
"""
from __future__ import annotations

import os
import secrets
import socket
from pathlib import Path

from scaletrain.errors import ScaletrainError

TOKEN_PREFIX = ".scaletrain-shared-check-"


def nearest_existing(path: Path) -> Path:
    """``path`` or its nearest parent that exists (the run directory may not be made yet)."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def sees(token: Path, content: str) -> bool:
    try:
        return token.read_text() == content
    except OSError:
        return False


def blind_hosts(results: list[tuple[str, bool]]) -> dict[str, list[int]]:
    """{host: [ranks]} of the ranks that did not read the token."""
    out: dict[str, list[int]] = {}
    for r, (host, ok) in enumerate(results):
        if not ok:
            out.setdefault(host, []).append(r)
    return out


def blind_line(out_dir: Path, writer: str, blind: dict[str, list[int]]) -> str:
    hosts = ", ".join(f"{h} (rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))})" for h, rs in blind.items())
    return (f"train.out_dir {out_dir} is not the same directory on every host: {hosts} cannot see a file "
            f"{writer} (rank 0) wrote there; put train.out_dir on a filesystem every host mounts at the same path "
            f"(NFS, Lustre, ...); nothing was written")


def check_shared_run_dir(out_dir, rank: int, world_size: int) -> None:
    """Collective: raise :class:`ScaletrainError` (exit 2) on every rank if some rank does not see the
    token rank 0 wrote in ``out_dir``; the token is removed in any case."""
    import torch.distributed as dist

    if world_size == 1 or not dist.is_initialized():
        return
    out_dir = Path(out_dir)
    msg: list = [None]
    token = None
    if rank == 0:
        content = secrets.token_hex(16)
        token = nearest_existing(out_dir) / f"{TOKEN_PREFIX}{content[:12]}"
        try:
            token.write_text(content)
            msg = [(str(token), content, socket.gethostname())]
        except OSError as e:
            msg = [("", f"{type(e).__name__}: {e}", socket.gethostname())]
    dist.broadcast_object_list(msg, src=0)
    path, content, writer = msg[0]
    try:
        if not path:
            raise ScaletrainError(f"cannot write in train.out_dir {out_dir} (or its nearest existing parent): "
                                  f"{content}; fix its permissions or choose another train.out_dir")
        ok = rank == 0 or sees(Path(path), content)
        results: list = [None] * world_size
        dist.all_gather_object(results, (socket.gethostname(), ok))
    finally:
        if token is not None:
            token.unlink(missing_ok=True)
    blind = blind_hosts(results)
    if blind:
        raise ScaletrainError(blind_line(out_dir, writer, blind))
