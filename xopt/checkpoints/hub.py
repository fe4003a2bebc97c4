"""``from_pretrained`` / ``save_pretrained`` / ``push_to_hub`` for the learned optimizers.

Local directories work without huggingface_hub (any format :func:`xopt.checkpoints.detect`
knows). A Hub repository id is fetched with ``huggingface_hub.snapshot_download``, imported
only then; without it the error names the extra to install (``xopt-ml[hub]``). PyLO keeps
VeLO as two repositories (``VeLORNN`` and ``VeLOMLP``): pass them as a pair
``(rnn_repo_id, mlp_repo_id)``.
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
Source = str | os.PathLike[str] | Sequence[str]


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


def load_pretrained(source: Source, *, revision: str | None = None, token: str | None = None,
                    decays: Any = None, **overrides: Any) -> tuple[str, Any, dict[str, Any]]:
    """``(method, hp, θ canonical)`` from a local directory, a Hub repository id, or a
    pair ``(rnn, mlp)`` of PyLO VeLO directories or repository ids."""
    if isinstance(source, (list, tuple)):
        if len(source) != 2:
            raise CheckpointError(f"expected (rnn, mlp) for PyLO VeLO, got {len(source)} items")
        dirs = [Path(s) if Path(s).is_dir() else _download(str(s), revision, token)
                for s in source]
        if decays is not None:
            raise CheckpointError("decays= is for small_fc_lopt (MetaMLP); this is VeLO")
        try:
            hp, theta = pylo.read_velo_pair(dirs[0], dirs[1], **overrides)
        except CheckpointError:
            raise
        except XoptError as e:
            raise CheckpointError(f"{dirs[0]}, {dirs[1]}: {e}") from None
        return "velo", hp, theta
    path = Path(source)
    if not path.exists():
        if not _REPO_ID.fullmatch(str(source)):
            raise CheckpointError(f"{source}: no such checkpoint directory")
        path = _download(str(source), revision, token)  # an 'owner/name' Hub repository
    return C.load(path, decays=decays, **overrides)


def from_pretrained(cls: type, params: Any, source: Source, *, check_finite: bool = False,
                    revision: str | None = None, token: str | None = None, decays: Any = None,
                    **hyperparameters: Any) -> Any:
    """An optimizer of class ``cls`` over ``params`` with θ and the stored hyperparameters
    of ``source``; ``hyperparameters`` (``num_training_steps=...``) override or supply the
    fields the checkpoint does not hold."""
    given = {k: v for k, v in hyperparameters.items() if v is not None}
    method, hp, theta = load_pretrained(source, revision=revision, token=token, decays=decays,
                                        **given)
    want = cls.hyperparams_cls.METHOD
    if method != want:
        raise CheckpointError(f"{source}: holds a {method} checkpoint, not {want}")
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
    """Upload the checkpoint to the Hub (a pair of ids for PyLO VeLO). Returns the commit
    URLs."""
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


def optax_from_pretrained(source: Source, *, check_finite: bool = False,
                          revision: str | None = None, token: str | None = None,
                          decays: Any = None, **hyperparameters: Any) -> Any:
    """The JAX side of :func:`from_pretrained`: the optax transformation
    (``xopt.jax.small_fc_lopt`` or ``xopt.jax.velo``) with θ and the hyperparameters of
    ``source``; ``hyperparameters`` override or supply what the checkpoint lacks."""
    import importlib

    given = {k: v for k, v in hyperparameters.items() if v is not None}
    method, hp, theta = load_pretrained(source, revision=revision, token=token, decays=decays,
                                        **given)
    factory = getattr(importlib.import_module(f"xopt.jax.{method}"), method)
    return factory(theta, spec=hp, check_finite=check_finite)


def save_optax_pretrained(meta_params: Mapping[str, Any], hp: Any,
                          save_directory: str | os.PathLike[str], *, format: str = "xopt",
                          overwrite: bool = True) -> Path:
    """The JAX side of ``save_pretrained``: θ (either naming, any array type) and the
    hyperparameters ``hp`` (the spec dataclass the transformation was built from)."""
    return save_pretrained(hp.METHOD, hp, meta_params, save_directory, format=format,
                           overwrite=overwrite)
