"""``from_pretrained`` / ``save_pretrained`` / ``push_to_hub`` for the learned optimizers.

The Hub is reached only when asked by name: a source is a local path unless it is written
``hf://owner/name`` or passed as ``repo_id=``; a local path that does not exist is an error
naming it (never a download of a repository that happens to be called the same). Local
directories work without huggingface_hub (any format :func:`xopt.checkpoints.detect`
knows); a Hub repository is fetched with ``huggingface_hub.snapshot_download``, imported
only then, and without it the error names the extra to install (``xopt-ml[hub]``). PyLO
keeps VeLO as two repositories (``VeLORNN`` and ``VeLOMLP``): pass them as a pair
``("hf://owner/rnn", "hf://owner/mlp")`` (or ``repo_id=(rnn, mlp)``).
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from xopt import checkpoints as C
from xopt.checkpoints import pylo
from xopt.errors import CheckpointError, XoptError

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
HF = "hf://"
Source = str | os.PathLike[str] | Sequence[str]


def hub_repo(source: Any) -> str | None:
    """The repository id of an explicit Hub source (``"hf://owner/name"``), else None."""
    if not isinstance(source, str) or not source.startswith(HF):
        return None
    repo = source[len(HF):]
    if not _REPO_ID.fullmatch(repo):
        raise CheckpointError(f"{source}: not a Hub repository id (expected hf://owner/name)")
    return repo


def _repo_arg(repo_id: Any) -> str:
    repo = hub_repo(repo_id) if isinstance(repo_id, str) and repo_id.startswith(HF) else repo_id
    if not isinstance(repo, str) or not _REPO_ID.fullmatch(repo):
        raise CheckpointError(f"repo_id={repo_id!r}: not a Hub repository id (owner/name)")
    return repo


def _local_or_hub(source: Any, revision: str | None, token: str | None) -> Path:
    """A local directory (which must exist), or the download of an ``hf://`` source."""
    repo = hub_repo(source)
    if repo is not None:
        return _download(repo, revision, token)
    path = Path(source)
    if not path.exists():
        hint = (f" (for the Hugging Face Hub repository, write hf://{source})"
                if _REPO_ID.fullmatch(str(source)) else "")
        raise CheckpointError(f"{source}: no such checkpoint directory{hint}")
    return path


def _hub() -> Any:
    try:
        import huggingface_hub
    except ImportError:
        raise ImportError("Hugging Face Hub access needs huggingface_hub: "
                          "pip install 'xopt-ml[hub]' (local directories work without it)"
                          ) from None
    return huggingface_hub


def _download(repo_id: str, revision: str | None, token: str | None) -> Path:
    return Path(_hub().snapshot_download(repo_id=repo_id, revision=revision, token=token))


def load_pretrained(source: Source | None = None, *, repo_id: str | Sequence[str] | None = None,
                    revision: str | None = None, token: str | None = None,
                    decays: Any = None, method: str | None = None,
                    **overrides: Any) -> tuple[str, Any, dict[str, Any]]:
    """``(method, hp, θ canonical)`` from a local directory, a Hub repository
    (``"hf://owner/name"`` or ``repo_id="owner/name"``), or a pair ``(rnn, mlp)`` of PyLO
    VeLO directories or repositories. ``method``: the method it must hold (and, for a PyLO
    ``MetaMLP``, which of small_fc_lopt and μLO to read it as)."""
    if (source is None) == (repo_id is None):
        raise CheckpointError("pass either a source (a local path or 'hf://owner/name') or "
                              "repo_id=, not both" if source is not None else
                              "no checkpoint given: pass a local path, 'hf://owner/name' or "
                              "repo_id=")
    if repo_id is not None:
        source = ([HF + _repo_arg(r) for r in repo_id] if isinstance(repo_id, (list, tuple))
                  else HF + _repo_arg(repo_id))
    if isinstance(source, (list, tuple)):
        if len(source) != 2:
            raise CheckpointError(f"expected (rnn, mlp) for PyLO VeLO, got {len(source)} items")
        dirs = [_local_or_hub(s, revision, token) for s in source]
        if decays is not None:
            raise CheckpointError("decays= is for small_fc_lopt (MetaMLP); this is VeLO")
        try:
            hp, theta = pylo.read_velo_pair(dirs[0], dirs[1], **overrides)
        except CheckpointError:
            raise
        except XoptError as e:
            raise CheckpointError(f"{dirs[0]}, {dirs[1]}: {e}") from None
        if method not in (None, "velo"):
            raise CheckpointError(f"{source}: holds a velo checkpoint, not {method}")
        return "velo", hp, theta
    return C.load(_local_or_hub(source, revision, token), decays=decays, method=method,
                  **overrides)


def from_pretrained(cls: type, params: Any, source: Source | None = None, *,
                    repo_id: str | Sequence[str] | None = None, check_finite: bool = False,
                    revision: str | None = None, token: str | None = None, decays: Any = None,
                    **hyperparameters: Any) -> Any:
    """An optimizer of class ``cls`` over ``params`` with θ and the stored hyperparameters
    of ``source`` (a local path or ``"hf://owner/name"``) or of the Hub's ``repo_id``;
    ``hyperparameters`` (``num_training_steps=...``) override or supply the fields the
    checkpoint does not hold."""
    given = {k: v for k, v in hyperparameters.items() if v is not None}
    want = cls.hyperparams_cls.METHOD
    method, hp, theta = load_pretrained(source, repo_id=repo_id, revision=revision,
                                        token=token, decays=decays, method=want, **given)
    if method != want:
        raise CheckpointError(f"{source or repo_id}: holds a {method} checkpoint, not {want}")
    return cls(params, theta, spec=hp, check_finite=check_finite)


def save_pretrained(method: str, hp: Any, theta: Mapping[str, Any],
                    save_directory: str | os.PathLike[str], *, format: str = "xopt",
                    overwrite: bool = True) -> Path:
    """Write θ and the hyperparameters to ``save_directory`` (atomically; replaces an
    existing directory unless ``overwrite=False``, as Hugging Face's ``save_pretrained``)."""
    return C.save(save_directory, method, hp, theta, format, overwrite=overwrite)


def push_to_hub(method: str, hp: Any, theta: Mapping[str, Any], repo_id: str | Sequence[str],
                *, format: str = "xopt", private: bool | None = None,
                token: str | None = None, commit_message: str = "Upload learned optimizer"
                ) -> list[str]:
    """Upload the checkpoint to the Hub (``"owner/name"`` or ``"hf://owner/name"``; a pair for
    PyLO VeLO). Returns the commit URLs."""
    repo_id = ([_repo_arg(r) for r in repo_id] if isinstance(repo_id, (list, tuple))
               else _repo_arg(repo_id))
    hub = _hub()
    api = hub.HfApi(token=token)
    with tempfile.TemporaryDirectory() as tmp:
        out = C.save(Path(tmp) / "ckpt", method, hp, theta, format)
        if isinstance(repo_id, (list, tuple)):
            if not (format == "pylo" and method == "velo" and len(repo_id) == 2):
                raise CheckpointError("a pair of repo ids is only for PyLO VeLO (rnn, mlp)")
            folders = [(repo_id[0], out / pylo.RNN_DIR), (repo_id[1], out / pylo.MLP_DIR)]
        elif format == "pylo" and method == "velo":
            raise CheckpointError("PyLO keeps VeLO as two repositories: pass "
                                  "repo_id=(rnn_repo_id, mlp_repo_id)")
        else:
            folders = [(repo_id, out)]
        urls = []
        for rid, folder in folders:
            api.create_repo(rid, private=private, exist_ok=True)
            info = api.upload_folder(repo_id=rid, folder_path=str(folder),
                                     commit_message=commit_message)
            urls.append(str(getattr(info, "commit_url", info)))
        return urls


def optax_from_pretrained(source: Source | None = None, *,
                          repo_id: str | Sequence[str] | None = None, check_finite: bool = False,
                          revision: str | None = None, token: str | None = None,
                          decays: Any = None, method: str | None = None,
                          mup_lrs: Any = None, **hyperparameters: Any) -> Any:
    """The JAX side of :func:`from_pretrained`: the optax transformation
    (``xopt.jax.small_fc_lopt``, ``xopt.jax.velo`` or ``xopt.jax.mulo``) with θ and the
    hyperparameters of ``source`` (a local path or ``"hf://owner/name"``) or ``repo_id``;
    ``hyperparameters`` override or supply what the checkpoint lacks; ``method`` as
    :func:`load_pretrained` (``"mulo"`` for μLO's PyLO ``MetaMLP``); ``mup_lrs``: μLO's
    per-parameter multipliers (:func:`xopt.jax.mulo.mulo`'s argument)."""
    import importlib

    given = {k: v for k, v in hyperparameters.items() if v is not None}
    method, hp, theta = load_pretrained(source, repo_id=repo_id, revision=revision,
                                        token=token, decays=decays, method=method, **given)
    factory = getattr(importlib.import_module(f"xopt.jax.{method}"), method)
    if mup_lrs is not None:
        if method != "mulo":
            raise CheckpointError(f"mup_lrs= is for μLO; the checkpoint holds {method}")
        return factory(theta, spec=hp, check_finite=check_finite, mup_lrs=mup_lrs)
    return factory(theta, spec=hp, check_finite=check_finite)


def save_optax_pretrained(meta_params: Mapping[str, Any], hp: Any,
                          save_directory: str | os.PathLike[str], *, format: str = "xopt",
                          overwrite: bool = True) -> Path:
    """The JAX side of ``save_pretrained``: θ (either naming, any array type) and the
    hyperparameters ``hp`` (the spec dataclass the transformation was built from)."""
    return save_pretrained(hp.METHOD, hp, meta_params, save_directory, format=format,
                           overwrite=overwrite)
