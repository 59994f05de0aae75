"""What every role of a run shares: the run record, the dataset snapshot, tokenizer, queues.

``<root>/runs/<run_id>/run.json`` is written once, by the first process of a run. A later
start with the same run id must carry the same config (apart from ``trainer.total_steps``,
which may grow to extend a run); a different config is refused unless the caller forks.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field, fields
from functools import cached_property
from pathlib import Path
from typing import Any

from relax import objstore
from relax.config import ConfigError, RelaxConfig, SupervisorConfig, config_to_dict, saved_config
from relax.data.snapshot import Snapshot
from relax.data.sources import snapshot_from_config
from relax.data.suite import TASKS, load_env_fn, load_reward_fn
from relax.services.queue_contract import ROLLOUT_TOPIC
from relax.transfer.lineage import code_version
from relax.transfer.queue import TransferQueue
from relax.transfer.weights import WeightStore

# model families whose processors take images / audio (relax.models.processors)
IMAGE_FAMILIES = ("qwen2_5_vl", "qwen2_5_omni")
AUDIO_FAMILIES = ("qwen2_audio", "qwen2_5_omni")
# how a run is operated, not what it computes: a rerun may change them
RESUMABLE_FIELDS = {"trainer.total_steps", "rollout.api_port", "rollout.api_host", "rollout.max_engine_processes",
                    *(f"supervisor.{f.name}" for f in fields(SupervisorConfig)),
                    # a checkpoint, gathered or sharded, loads by Hugging Face name at any layout
                    "trainer.data_parallel", "trainer.tensor_parallel", "trainer.pipeline_parallel",
                    "trainer.context_parallel", "trainer.checkpoint_format"}


class RunConfigMismatch(ValueError):
    pass


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


@dataclass
class RunContext:
    cfg: RelaxConfig
    _splits: dict[str, list] = field(default_factory=dict, repr=False)

    @property
    def root(self) -> str:
        return objstore.absolute_url(self.cfg.root)

    @property
    def run_url(self) -> str:
        return objstore.join(self.root, "runs", self.cfg.run_id)

    # -- run record ------------------------------------------------------------------------
    def ensure_run(self, fork: bool = False) -> dict[str, Any]:
        """Create ``run.json`` or check this config against it; returns the record."""
        url = objstore.join(self.run_url, "run.json")
        if objstore.exists(url):
            record = json.loads(objstore.read_bytes(url))
            saved = _flat(saved_config(record["config"]))
            mine = _flat(config_to_dict(self.cfg))
            # A setting added to Relax after the run started is absent from run.json; at its
            # default it changes nothing, so upgrading Relax does not orphan a run.
            defaults = _flat(config_to_dict(RelaxConfig()))
            diff = sorted(k for k in set(saved) | set(mine)
                          if k not in RESUMABLE_FIELDS and saved.get(k) != mine.get(k)
                          and not (k not in saved and mine.get(k) == defaults.get(k)))
            if diff and not fork:
                shown = ", ".join(f"{k}: {saved.get(k)!r} -> {mine.get(k)!r}" for k in diff[:5])
                raise RunConfigMismatch(
                    f"run {self.cfg.run_id!r} at {self.run_url} was started with a different config ({shown}); "
                    f"use a new run_id, restore those values, or fork it (relax train --fork) to start a new "
                    f"run from its latest checkpoint")
            return record
        record = {"run_id": self.cfg.run_id, "config": config_to_dict(self.cfg), "code_version": code_version(),
                  "dataset_snapshot": self.snapshot_info.id, "created_at": time.time()}
        objstore.write_bytes(url, json.dumps(record, indent=1, sort_keys=True).encode())
        return record

    # -- data and model ---------------------------------------------------------------------
    @cached_property
    def snapshot_info(self):
        return snapshot_from_config(self.cfg.data, self.root)

    @cached_property
    def snapshot(self) -> Snapshot:
        return Snapshot(self.snapshot_info.url)

    def split(self, name: str) -> list:
        """A snapshot split, read and checksummed once per context (the roles of a colocated run share it)."""
        if name not in self._splits:
            self._splits[name] = list(self.snapshot.samples(name))
        return self._splits[name]

    # relax.models (torch, transformers: ~4 s) is imported where a model is built, so processes that only
    # read the store (`relax status`, the CLI's start-up) stay light
    @cached_property
    def tokenizer(self):
        from relax.models import build_tokenizer

        return build_tokenizer(self.cfg.model.tokenizer)

    def build_model(self):
        """``(model, processor)``: the initial policy (seeded), identical in every process."""
        from relax.models import build_policy

        return build_policy(self.cfg.model, self.tokenizer, seed=self.cfg.seed)

    @cached_property
    def processor(self):
        """The model's media processor (None for text models), from its config alone: a rollout
        with remote engines expands media placeholders itself and builds no weights."""
        from relax.models import build_processor

        return build_processor(self.cfg.model, self.tokenizer)

    def check_trainable(self, engine_urls: list[str] | None = None, *, teacher: bool = True) -> None:
        """Fail before any role starts on data the configured engines cannot serve, or on an
        extension point (``data.reward_fn``, ``rollout.env_fn``) that does not import. ``teacher``:
        also the distillation teacher (False for work that never scores with it: the format warm-start,
        evaluation, which must not ask a served teacher for its vocabulary each time)."""
        _ = self.cfg.data.reward_fn and load_reward_fn(self.cfg.data.reward_fn)
        _ = self.cfg.rollout.env_fn and load_env_fn(self.cfg.rollout.env_fn)
        self._check_model_folder()
        if teacher and self.cfg.teacher.name_or_path:
            self._check_teacher()
        if teacher and self.cfg.teacher.url:
            self._check_served_teacher()
        train = self.split("train")
        family = self.cfg.model.family
        for kind, has, families in (("images", lambda s: s.images, IMAGE_FAMILIES),
                                    ("audio", lambda s: s.audios, AUDIO_FAMILIES),
                                    ("videos", lambda s: s.videos, IMAGE_FAMILIES)):
            tasks = sorted({s.task for s in train if has(s)})
            if tasks and family not in families:
                raise ConfigError(f"tasks {tasks} carry {kind}, but model.family={family!r} takes none; use a "
                                  f"family in {list(families)} (e.g. model.name_or_path=tiny-omni "
                                  f"model.family=qwen2_5_omni) or drop those tasks")
        if self.cfg.data.reward_role:
            agents = sorted({s.task for s in train if TASKS.get(s.task) and TASKS[s.task].make_env})
            if agents:
                raise ConfigError(f"data.reward_role=true: tasks {agents} are agent episodes whose reward comes from "
                                  f"their env during the rollout; drop them or set data.reward_role=false")
        self._check_backends(engine_urls)
        media = sorted({s.task for s in train if s.images or s.audios or s.videos})
        if media and self.cfg.trainer.backend != "torch":
            raise ConfigError(f"tasks {media} carry images/audio; trainer.backend={self.cfg.trainer.backend!r} "
                              f"trains text only, use trainer.backend=torch")
        videos = sorted({s.task for s in train if s.videos})
        r = self.cfg.rollout
        if videos and (engine_urls or r.engine_processes > 0 or r.engine == "sglang"):
            raise ConfigError(f"tasks {videos} carry videos, which only the in-process native engine takes yet (HTTP "
                              f"engines are sent images and audio): use rollout.engine=native with "
                              f"rollout.engine_processes=0 and no --engine-url")

    def _check_model_folder(self) -> None:
        """A local model folder's ``config.json`` decides its classes: ``model.family`` must name them
        (a family the folder is not would otherwise be ignored)."""
        m = self.cfg.model
        config = Path(m.name_or_path).expanduser() / "config.json"
        if not config.is_file():  # a built-in, or a name the model builder refuses with its own error
            return
        model_type = json.loads(config.read_text()).get("model_type", "")
        if model_type not in (m.family, f"{m.family}_thinker"):
            raise ConfigError(f"model.family={m.family!r}, but {m.name_or_path} holds a {model_type!r} model "
                              f"(its config.json), which decides the classes: set model.family="
                              f"{model_type.removesuffix('_thinker')}")

    def _check_teacher(self) -> None:
        """On-policy distillation compares log-probs token by token: the teacher must read the student's
        vocabulary (same tokens, same ids), be of its family, and its checkpoint must be one."""
        from relax.models import build_tokenizer

        t, m = self.cfg.teacher, self.cfg.model
        if t.tokenizer and t.tokenizer != m.tokenizer:
            theirs, ours = build_tokenizer(t.tokenizer).get_vocab(), self.tokenizer.get_vocab()
            if theirs != ours:
                raise ConfigError(f"teacher.tokenizer={t.tokenizer!r} ({len(theirs)} tokens) is not the student's "
                                  f"model.tokenizer={m.tokenizer!r} ({len(ours)} tokens): distillation compares the "
                                  f"two models token by token, so they need one vocabulary; use a teacher trained "
                                  f"with the student's tokenizer")
        config = Path(t.name_or_path).expanduser() / "config.json"
        if config.is_file():
            model_type = json.loads(config.read_text()).get("model_type", "")
            if model_type not in (m.family, f"{m.family}_thinker"):
                raise ConfigError(f"teacher.name_or_path={t.name_or_path} holds a {model_type!r} model and the "
                                  f"student is model.family={m.family!r}: the teacher is built as the student's "
                                  f"family; use a teacher of that family")
        if t.checkpoint and not objstore.exists(objstore.join(t.checkpoint, "meta.json")):
            raise ConfigError(f"teacher.checkpoint={t.checkpoint!r} is not a Relax checkpoint (no meta.json there); "
                              f"point it at <root>/runs/<run>/checkpoints/step-NNNNNN of a finished run")

    def _check_served_teacher(self) -> None:
        """teacher.url scores token ids alone: text rows, and a server that knows every id the student emits."""
        from relax.services.roles.teacher_remote import RemoteTeacher

        url = self.cfg.teacher.url
        media = next((s for s in self.split("train") if s.images or s.audios or s.videos), None)
        if media is not None:
            raise ConfigError(f"teacher.url={url} scores token ids only, and training row {media.id!r} "
                              f"({media.task}) carries media: distil media tasks from a local teacher "
                              f"(teacher.name_or_path)")
        try:
            size = RemoteTeacher(url).vocab_size()
        except Exception as e:  # unreachable, refused, not an engine
            raise ConfigError(f"teacher.url={url} does not answer /get_model_info ({type(e).__name__}: {e}); "
                              f"start the teacher's engine server first") from None
        if size is not None and size < len(self.tokenizer):
            raise ConfigError(f"teacher.url={url} serves a {size}-token vocabulary and the student's tokenizer has "
                              f"{len(self.tokenizer)} tokens: serve the teacher with the student's tokenizer")

    def _check_backends(self, engine_urls: list[str] | None) -> None:
        """The packages and devices the chosen backends need are here (or the run stops naming which)."""
        import importlib.util

        # find_spec, not import: megatron.core takes seconds to import and the actor imports it anyway
        if self.cfg.trainer.backend == "megatron" and importlib.util.find_spec("megatron") is None:
            raise ConfigError("trainer.backend=megatron needs megatron-core: pip install --no-deps "
                              "megatron-core==0.16.1, or use trainer.backend=torch")
        if self.cfg.trainer.backend == "megatron":
            self._check_megatron_layout()
        if engine_urls and self.cfg.rollout.partial_rollout == "abort":  # only the in-process engine aborts
            raise ConfigError("rollout.partial_rollout=abort would change nothing with --engine-url (engines over "
                              "HTTP finish what they started): use rollout.partial_rollout=wait")
        r = self.cfg.rollout
        if r.agents == "external":  # the gateway's token is the agents': the engines' would let them swap weights
            from relax.engines.guards import AGENT_TOKEN_ENV, TOKEN_ENV

            agent, engine = os.environ.get(AGENT_TOKEN_ENV), os.environ.get(TOKEN_ENV)
            if not agent or agent == engine:
                raise ConfigError(f"rollout.agents=external: set {AGENT_TOKEN_ENV} to a secret your agents send to the "
                                  f"session gateway (its own: not {TOKEN_ENV}, which controls the run's engines)")
        if r.weight_sync == "broadcast" and not (engine_urls or r.engine_processes > 0 or r.engine == "sglang"):
            raise ConfigError("rollout.weight_sync=broadcast sends weights to engine servers, and this rollout runs its "
                              "engine in-process: set rollout.engine_processes >= 1 (or rollout.engine=sglang, or "
                              "--engine-url), or rollout.weight_sync=disk")
        if self.cfg.rollout.engine == "sglang" and not engine_urls:
            why = self._sglang_missing()
            if why:
                raise ConfigError(f"rollout.engine=sglang: {why}; or start SGLang servers yourself and pass their "
                                  f"URLs with --engine-url, or use rollout.engine=native")

    def _check_megatron_layout(self) -> None:
        """The trainer's tensor/pipeline sizes divide the model (heads, query groups, vocabulary,
        layers), checked on the model's config before any process group starts."""
        from relax.models.builders import policy_config
        from relax.trainers.megatron.convert import check_tp, layout_from_hf_config

        t = self.cfg.trainer
        layout = layout_from_hf_config(policy_config(self.cfg.model, self.tokenizer))
        try:
            check_tp(layout, t.tensor_parallel)
        except ValueError as e:
            raise ConfigError(f"trainer.tensor_parallel={t.tensor_parallel} does not divide this model: {e}") from None
        if layout.num_layers % t.pipeline_parallel:
            raise ConfigError(f"trainer.pipeline_parallel={t.pipeline_parallel} does not divide the model's "
                              f"{layout.num_layers} layers: choose a divisor of {layout.num_layers}")
        import torch

        if layout.num_experts and t.pipeline_parallel > 1 and not torch.cuda.is_available():
            raise ConfigError(f"trainer.pipeline_parallel={t.pipeline_parallel} with an MoE model needs megatron's "
                              f"alltoall token dispatcher, which needs CUDA: use pipeline_parallel=1 on a CPU")
        if t.expert_parallel > 1 and (not layout.num_experts or layout.num_experts % t.expert_parallel):
            raise ConfigError(f"trainer.expert_parallel={t.expert_parallel} splits an MoE model's experts and this "
                              f"model has {layout.num_experts} per layer: use an MoE family (qwen2_moe, qwen3_moe) "
                              f"whose expert count it divides, or expert_parallel=1")
        if layout.num_experts and t.tensor_parallel > 1:  # megatron trains MoE + TP only with sequence parallel
            raise ConfigError(f"trainer.tensor_parallel={t.tensor_parallel} with an MoE model needs megatron's "
                              f"sequence parallelism, which the actor does not run yet (docs/megatron.md): use "
                              f"tensor_parallel=1 with data_parallel")

    def _sglang_missing(self) -> str | None:
        """What stops the rollout from launching its SGLang servers here, if anything."""
        import importlib.util

        r = self.cfg.rollout
        if objstore.local_path(self.cfg.root) is None:
            return (f"SGLang loads each weight version from a local folder and root={self.cfg.root!r} is not one: "
                    f"use a local or shared-filesystem root")
        if r.sglang_module != "sglang.launch_server":  # a stand-in (tests), which must declare itself
            from relax.services.launchers.sglang_process import server_module_problem

            return server_module_problem(r.sglang_module)
        if importlib.util.find_spec("sglang") is None:
            return "the sglang package is not installed (pip install sglang on a GPU machine)"
        from relax.engines.sglang.launch import tp_size
        from relax.services.launchers.sglang_process import visible_gpus

        if r.engine_launcher == "ray":  # the cluster's GPUs, not this host's: the launch checks Ray's free ones
            return None
        need, have = r.num_engines * tp_size(self.cfg), len(visible_gpus())
        if have < need:
            return (f"rollout.num_engines={r.num_engines} server(s) of {tp_size(self.cfg)} GPU(s) each need {need} "
                    f"GPUs and {have} are visible")
        return None

    # -- transfer ---------------------------------------------------------------------------
    def queue(self, **kwargs: Any) -> TransferQueue:
        return TransferQueue.from_config(self.cfg, ROLLOUT_TOPIC, **kwargs)

    def weights(self) -> WeightStore:
        return WeightStore(self.cfg.root, self.cfg.run_id, fsync=self.cfg.queue.fsync)

    @property
    def batch_size(self) -> int:
        return self.cfg.rollout.prompts_per_step * self.cfg.rollout.n_samples_per_prompt
