"""Where an engine's ``/update_weights_from_disk`` reads new weights from.

``model_path`` names one of three sources (docs/engines.md, "Weights"): a WeightStore version
URL (``<root>/runs/<run>/weights/<n>``), a bare version number when the server was started with
``--weight-store-root``/``--run-id``, or a local folder of ``*.safetensors`` files (an HF save).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

_VERSION_URL = re.compile(r"^(?P<root>.*)/runs/(?P<run>[^/]+)/weights/(?P<version>\d+)/?$")


def _local(path: str) -> Path | None:
    """The resolved local path of ``path`` (plain or file://), None for other fsspec URLs."""
    if "://" in path and not path.startswith("file://"):
        return None
    return Path(os.path.realpath(Path(path.removeprefix("file://")).expanduser()))


def check_source(path: str, store_root: str | None, run_id: str | None, served: str) -> None:
    """Refuse (PermissionError) a ``model_path`` outside what this engine may load: a version of its
    own run's WeightStore (``store_root`` *and* ``run_id``: a version number or its exact URL, loaded
    through its manifest and file digests) and the folder it serves. Any other folder (a scratch folder
    or another version's files under the store, named as a folder, would load without a manifest
    and take the folder's name as their version), another run, ``../`` or a URL a caller names
    would make the server read (or fetch) it."""
    mine = bool(store_root and run_id)
    if path.isdigit() and mine:
        return
    m = _VERSION_URL.match(path.rstrip("/"))
    if m and mine and m["run"] == run_id:
        given, root = _local(m["root"]), _local(store_root)
        if (given is not None and given == root) or m["root"].rstrip("/") == store_root.rstrip("/"):
            return
    local = _local(path)
    base = _local(served)
    if not m and local is not None and base is not None and (local == base or base in local.parents):
        return
    allowed = [x for x in (f"{store_root}/runs/{run_id}/weights/<n>" if mine else None, served) if x]
    raise PermissionError(f"model_path {path!r} is outside what this engine loads from ({', '.join(allowed)}); "
                          f"start it with --weight-store-root <root> --run-id <run> of the run that updates it")


def store_version(path: str, store_root: str | None, run_id: str | None) -> tuple[Any, int] | None:
    """``(WeightStore, version)`` that ``path`` names (a version URL, or a bare number with
    ``store_root``/``run_id`` configured); None for a folder."""
    from relax.transfer.weights import WeightStore

    m = _VERSION_URL.match(path.rstrip("/"))
    if m:
        return WeightStore(m["root"], m["run"]), int(m["version"])
    if path.isdigit() and store_root and run_id:
        return WeightStore(store_root, run_id), int(path)
    return None


def load_weights(path: str, store_root: str | None, run_id: str | None) -> tuple[dict[str, Any], str]:
    """``(state_dict, version)`` from a WeightStore version URL, a bare version number (with
    ``store_root``/``run_id`` configured) or a local folder of ``*.safetensors`` (an HF save)."""
    from relax.transfer.adapter_versions import load_version

    found = store_version(path, store_root, run_id)
    if found is not None:  # an adapter version comes as an AdapterVersion (relax.engines.adapter_load merges it)
        return load_version(*found), str(found[1])
    folder = Path(path.removeprefix("file://")).expanduser()
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        raise FileNotFoundError(f"{path!r} is neither a WeightStore version (<root>/runs/<run>/weights/<n>) "
                                "nor a folder with *.safetensors files")
    from safetensors.torch import load_file

    state: dict[str, Any] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state, folder.name


def complete_tied(state: dict[str, Any], model: Any) -> dict[str, Any]:
    """Fill the tensors a tied-embedding model shares with its input embedding (``lm_head.weight``),
    which ``save_pretrained`` leaves out of the files; other missing tensors stay missing (and fail)."""
    config = getattr(model, "config", None)
    text = getattr(config, "get_text_config", lambda: config)()
    if not getattr(text, "tie_word_embeddings", False) or not hasattr(model, "get_input_embeddings"):
        return state
    current = model.state_dict()
    shared = model.get_input_embeddings().weight.data_ptr()
    source = next((k for k, v in current.items() if v.data_ptr() == shared and k in state), None)
    if source is None:
        return state
    return {**state, **{k: state[source] for k, v in current.items() if k not in state and v.data_ptr() == shared}}
