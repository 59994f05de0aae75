"""``relax export``: a checkpoint as folders other tools load.

``relax export [preset|file] [key=value ...] --checkpoint URL --out DIR [--merge]``. A LoRA checkpoint
(``model.lora``, docs/lora.md) becomes a PEFT adapter folder (``adapter_config.json`` and
``adapter_model.safetensors``: ``peft.PeftModel.from_pretrained(base, DIR)`` and SGLang's
``--lora-paths``/``/load_lora_adapter`` load it); ``--merge`` writes the adapter merged into its base as a
plain Hugging Face folder instead, as a full checkpoint always is. The config gives the model family
and tokenizer; the adapter's shape and its base come from the checkpoint's own record.
"""

from __future__ import annotations

import argparse
import json

from relax.cli.args import CommandError, config_from_args
from relax.objstore import absolute_url


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="a checkpoint as a PEFT adapter folder or a (merged) Hugging Face folder",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("args", nargs="*", help="[preset or config file] then key=value overrides")
    p.add_argument("--checkpoint", required=True, help="the checkpoint folder URL to export")
    p.add_argument("--out", required=True, help="a local folder to write")
    p.add_argument("--merge", action="store_true", help="a LoRA adapter merged into its base (whole weights)")
    p.set_defaults(func=_export)


def _export(args: argparse.Namespace) -> int:
    from relax.services.policy import checkpoint_adapter, checkpoint_policy, lora_of
    from relax.services.run_context import RunContext
    from relax.trainers.checkpoint.files import CheckpointError
    from relax.trainers.checkpoint.trainer_state import export_hf

    ctx = RunContext(config_from_args(args.args))
    url = absolute_url(args.checkpoint)
    try:
        adapter = lora_of(url) is not None
        if adapter and not args.merge:
            model, _ = checkpoint_adapter(ctx, url)
            model.save_pretrained(args.out)
            ctx.tokenizer.save_pretrained(args.out)
        else:
            model, _ = checkpoint_policy(ctx, url)
            export_hf(model, args.out, ctx.tokenizer)
    except (CheckpointError, FileNotFoundError) as e:
        raise CommandError(f"cannot export {url}: {e}") from None
    kind = "PEFT adapter" if adapter and not args.merge else "merged model" if adapter else "model"
    print(json.dumps({"checkpoint": url, "out": args.out, "kind": kind}))
    return 0
