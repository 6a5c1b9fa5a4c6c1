"""Where a run came from, in MLflow's own tags: what the UI shows as *Source*, *Created by*, the git commit and
the run's description.

* ``mlflow.source.name`` (the command: ``scaletrain train``, ``scaletrain evaluate``) and
  ``mlflow.source.type`` (``LOCAL``);
* ``mlflow.source.git.commit`` / ``.branch`` / ``.repoURL``: the git checkout the job started in (the
  working directory), else the one scaletrain itself runs from;
* ``mlflow.user``: the user the process runs as;
* ``mlflow.note.content``: a paragraph describing the run (the caller writes it; MLflow shows it as the
  run's description).

MLflow's fluent ``mlflow.start_run`` sets the first four itself; the tracker creates runs with
``MlflowClient``, which sets none of them, hence this module.
"""
from __future__ import annotations

import getpass
import os
import subprocess
from pathlib import Path

__all__ = ["NOTE_TAG", "SOURCE_NAME", "git_info", "source_tags", "user_name"]

NOTE_TAG = "mlflow.note.content"
SOURCE_NAME = "mlflow.source.name"
_PACKAGE_DIR = Path(__file__).resolve().parents[1]


def _git(where: Path, *args: str) -> str | None:
    try:
        r = subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    out = r.stdout.strip()
    return out if r.returncode == 0 and out else None


def git_info(where: str | os.PathLike | None = None) -> dict[str, str]:
    """``commit``, ``branch`` and ``repo_url`` (a remote named origin, credentials removed) of the git
    checkout holding ``where`` (default: the working directory), else of scaletrain's own checkout; {}
    outside git."""
    for d in (Path(where) if where is not None else Path.cwd(), _PACKAGE_DIR):
        commit = _git(d, "rev-parse", "HEAD")
        if commit:
            info = {"commit": commit}
            branch = _git(d, "rev-parse", "--abbrev-ref", "HEAD")
            if branch and branch != "HEAD":
                info["branch"] = branch
            url = _git(d, "config", "--get", "remote.origin.url")
            if url:
                if "@" in url and "://" in url:  # https://user:token@host/... -> https://host/...
                    scheme, rest = url.split("://", 1)
                    url = f"{scheme}://{rest.split('@', 1)[1]}"
                info["repo_url"] = url
            return info
    return {}


def user_name() -> str:
    """The user this process runs as (``getpass.getuser()``, as MLflow's own context does)."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (some containers)
        return os.environ.get("USER") or (str(os.getuid()) if hasattr(os, "getuid") else "unknown")


def source_tags(command: str, where: str | os.PathLike | None = None) -> dict[str, str]:
    """MLflow's source, git and user tags for a run made by ``command`` (``scaletrain train``) started in
    ``where`` (default: the working directory)."""
    tags = {SOURCE_NAME: command, "mlflow.source.type": "LOCAL", "mlflow.user": user_name()}
    git = git_info(where)
    for key, tag in (("commit", "commit"), ("branch", "branch"), ("repo_url", "repoURL")):
        if key in git:
            tags[f"mlflow.source.git.{tag}"] = git[key]
    return tags
