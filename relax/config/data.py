"""The data section of the config (``data``): prompts, the dataset snapshot, rewards and the judge.

Beside it, the checks that read only this section.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from relax.config.fields import ConfigError, opt


@dataclass
class DataConfig:
    """Where prompts come from and how the dataset snapshot is cut."""

    snapshot: str = opt(
        "", "Id of a dataset snapshot under root (ds-..., printed by `relax data snapshot`) to train and evaluate on, "
        "as it was written. Empty = snapshot train_url, or the built-in suite.")
    train_url: str = opt(
        "",
        "jsonl or parquet file (any fsspec URL) with training rows; empty = the built-in task suite.",
    )
    eval_url: str = opt("", "Held-out rows (jsonl/parquet). Empty = split eval_fraction off train_url.")
    format: str = opt(
        "relax",
        "Row format of train_url/eval_url: 'relax' (the sample schema, docs/data.md) or 'gsm8k' "
        "({question, answer with '#### N'}).",
        choices=("relax", "gsm8k"),
    )
    tasks: list[str] = opt(
        ["arithmetic", "shapes", "tones", "tool_lookup"],
        "Built-in tasks to generate when train_url is empty (docs/tasks.md).",
    )
    train_per_task: int = opt(256, "Built-in suite: training prompts per task.", range=(1, 10_000_000))
    eval_per_task: int = opt(64, "Built-in suite: held-out prompts per task.", range=(1, 10_000_000))
    difficulty: int = opt(1, "Built-in suite difficulty level (1 easiest).", range=(1, 3))
    eval_fraction: float = opt(
        0.1, "Share of train_url rows held out (by a hash of the row id) when eval_url is empty.", range=(0.0, 0.9)
    )
    seed: int = opt(0, "Seed of the built-in suite generator (separate from the training seed).", range=(0, 2**63 - 1))
    allow_remote_media: bool = opt(
        False, "Let rows reference media by a URL outside the data file's folder (https://, s3://, gs://), fetched "
        "when the snapshot is made; off, such a row is an error. Local paths must stay inside that folder either way.")
    max_image_pixels: int = opt(
        16_777_216, "Largest image (width x height, read from its header) a snapshot accepts; 16777216 = 4096x4096.",
        range=(1, 1_000_000_000))
    max_audio_seconds: float = opt(
        300.0, "Longest audio clip (PCM WAV, duration read from its header) a snapshot accepts.", range=(0.01, 86400.0))
    max_video_frames: int = opt(
        1800, "Most frames a video (MP4 or frame folder) may hold for a snapshot to accept it; every frame is decoded "
        "once when the snapshot is planned.", range=(1, 10_000_000))
    max_video_seconds: float = opt(
        300.0, "Longest video a snapshot accepts (frames over the stream's frame rate).", range=(0.01, 86400.0))
    reward_fn: str = opt(
        "",
        "Dotted path 'package.module:function' of a custom reward(response, sample) -> float; empty = "
        "each task's own verifier.",
    )
    reward_role: bool = opt(
        False, "Score rewards in a role of its own (relax.services.roles.reward, docs/runtime.md) that commits reward "
        "and error per row, apart from generation. Not with rollout.dynamic_sampling, agent tasks or "
        "algorithm.advantage=gae.")
    judge_url: str = opt(
        "", "Base URL of an OpenAI-compatible /v1/chat/completions judge (a native Relax engine, SGLang, vLLM) that "
        "grades every response instead of the verifiers, answering <score>S</score> with S in [0, 1]; API key, if "
        "any, from RELAX_JUDGE_API_KEY. Empty = no judge.")
    judge_model: str = opt("judge", "The 'model' field sent to the judge server.")
    judge_timeout_s: float = opt(60.0, "Seconds to wait for one judgement.", range=(0.1, 3600.0))
    judge_concurrency: int = opt(16, "Judge requests in flight at once per rollout.", range=(1, 4096))


def check_one_reward_source(cfg: Any) -> None:
    if cfg.data.judge_url and cfg.data.reward_fn:
        raise ConfigError("data.judge_url and data.reward_fn both replace the task verifiers; set one of them")


def check_judge_url(cfg: Any) -> None:
    if cfg.data.judge_url and not cfg.data.judge_url.startswith(("http://", "https://")):
        raise ConfigError(f"data.judge_url {cfg.data.judge_url!r} must be an http(s) URL of an OpenAI-compatible "
                          f"server (e.g. http://judge-host:30000)")


def check_data_format(cfg: Any) -> None:
    """data.format reads data.train_url's rows; the built-in suite would ignore it."""
    d = cfg.data
    if d.format != "relax" and not d.train_url:
        raise ConfigError(f"data.format={d.format!r} is the row format of data.train_url/eval_url, and data.train_url "
                          f"is empty (the built-in task suite, which ignores it): set data.train_url to your "
                          f"{d.format} file, or data.format=relax")


SNAPSHOT_ID = re.compile(r"ds-[0-9a-f]{16}")


def check_snapshot(cfg: Any) -> None:
    """data.snapshot names the rows already; the settings that would make other rows contradict it."""
    d = cfg.data
    if not d.snapshot:
        return
    if not SNAPSHOT_ID.fullmatch(d.snapshot):
        raise ConfigError(f"data.snapshot={d.snapshot!r} is not a snapshot id: it looks like ds- and 16 hex digits, "
                          f"as `relax data snapshot` prints it (`relax data inspect ROOT` lists them)")
    given = [f"data.{k}" for k in ("train_url", "eval_url") if getattr(d, k)]
    if given:
        raise ConfigError(f"data.snapshot={d.snapshot} already names the rows, and {' and '.join(given)} name others: "
                          f"set data.snapshot or {given[0]}, not both")
