"""SGLang servers as Relax rollout engines (GPU only; sglang itself is an optional dependency)."""

from relax.engines.sglang.launch import SGLangServer, launch, server_args, update_weights_from_disk

__all__ = ["SGLangServer", "launch", "server_args", "update_weights_from_disk"]
