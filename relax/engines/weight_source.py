"""Where an engine's ``/update_weights_from_disk`` reads new weights from.

``model_path`` names one of three sources (docs/engines.md, "Weights"): a WeightStore version
URL (``<root>/runs/<run>/weights/<n>``), a bare version number when the server was started with
``--weight-store-root``/``--run-id``, or a local folder of ``*.safetensors`` files (an HF save).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

_VERSION_URL = re.compile(r"^(?P<root>.*)/runs/(?P<run>[^/]+)/weights/(?P<version>\d+)/?$")


def load_weights(path: str, store_root: str | None, run_id: str | None) -> tuple[dict[str, Any], str]:
    """``(state_dict, version)`` from a WeightStore version URL, a bare version number (with
    ``store_root``/``run_id`` configured) or a local folder of ``*.safetensors`` (an HF save)."""
    from relax.transfer.weights import WeightStore

    m = _VERSION_URL.match(path.rstrip("/"))
    if m:
        state, _ = WeightStore(m["root"], m["run"]).load(int(m["version"]))
        return state, str(int(m["version"]))
    if path.isdigit() and store_root and run_id:
        state, _ = WeightStore(store_root, run_id).load(int(path))
        return state, path
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
