"""The config checks that span sections: a setting that means something only with others beside it.

A check that reads one section lives beside that section (``relax.config.model``, ``.rollout``,
...); the ones here read several, such as a training mode (MoE routing replay, on-policy
distillation) and the settings it needs. Each refuses a combination that would be accepted and
then ignored, or fail mid-run, naming the fields and the way out. ``relax.config.tree.CHECKS``
runs them in order.
"""

from __future__ import annotations

from typing import Any

from relax.config.fields import ConfigError
from relax.config.model import MOE_FAMILIES
from relax.config.trainer import MEGATRON_FAMILIES


def check_gae_has_critic(cfg: Any) -> None:
    if cfg.algorithm.advantage == "gae" and not cfg.model.value_head:
        raise ConfigError("algorithm.advantage = 'gae' needs a critic: set model.value_head=true")


def check_megatron_family(cfg: Any) -> None:
    family = cfg.model.family
    if cfg.trainer.backend == "megatron" and family not in MEGATRON_FAMILIES:
        raise ConfigError(f"trainer.backend=megatron builds {list(MEGATRON_FAMILIES)} text models, not "
                          f"model.family={family!r}: use trainer.backend=torch")


def check_colocated_actor_ranks(cfg: Any) -> None:
    ranks = cfg.trainer.actor_processes
    if ranks > 1 and cfg.topology == "colocated" and cfg.algorithm.advantage == "gae":
        raise ConfigError(f"a {ranks}-rank actor (trainer.data/tensor/pipeline/context_parallel) in the colocated "
                          f"topology would share its process group with the critic, which trains in the same "
                          f"process: use topology=disaggregated (each role its own process) or a one-rank actor")


def check_ranks_have_samples(cfg: Any) -> None:
    t = cfg.trainer
    per_update = cfg.rollout.prompts_per_step * cfg.rollout.n_samples_per_prompt // max(1, t.mini_batches)
    if per_update < t.data_parallel:
        raise ConfigError(f"trainer.data_parallel={t.data_parallel} ranks but each optimizer step trains "
                          f"{per_update} samples (rollout.prompts_per_step x n_samples_per_prompt / "
                          f"trainer.mini_batches): every rank needs one; raise the batch or lower data_parallel")


def check_near_miss_credit(cfg: Any) -> None:
    if cfg.algorithm.near_miss_credit and (cfg.data.reward_fn or cfg.data.judge_url):
        raise ConfigError("algorithm.near_miss_credit shapes the built-in task verifiers, which data.reward_fn and "
                          "data.judge_url replace: give partial credit inside your own reward, or set it to 0")


def check_exact_staleness(cfg: Any) -> None:
    if cfg.queue.exact_staleness and cfg.rollout.partial_rollout == "abort":
        raise ConfigError("queue.exact_staleness pins each batch to one policy version, and rollout.partial_rollout="
                          "abort switches versions mid-generation: set partial_rollout=wait or exact_staleness=false")


def check_routing_replay(cfg: Any) -> None:
    """algorithm.routing_replay needs an MoE model on full rows (megatron: one pipeline stage); engines record
    routes (the native one, or SGLang with --enable-return-routed-experts, which the launchers pass)."""
    if not cfg.algorithm.routing_replay:
        return
    t = cfg.trainer
    clash = [(cfg.model.family not in MOE_FAMILIES, f"model.family={cfg.model.family} (routes exist for "
              f"{'/'.join(MOE_FAMILIES)} only)"),
             (t.micro_batch_layout == "prefix", "trainer.micro_batch_layout=prefix (replay needs full rows)"),
             (t.backend == "megatron" and t.pipeline_parallel > 1,
              f"trainer.pipeline_parallel={t.pipeline_parallel} (megatron's schedule does not replay routes yet)"),
             (t.backend == "megatron" and t.context_parallel > 1,
              f"trainer.context_parallel={t.context_parallel} (the replayed routes are not split over context ranks)")]
    found = [why for bad, why in clash if bad]
    if found:
        raise ConfigError(f"algorithm.routing_replay=true cannot run with {'; '.join(found)}: change those or set "
                          f"routing_replay=false")


def check_remote_teacher_temperature(cfg: Any) -> None:
    """teacher.url scores at temperature 1, as SGLang's prompt log-probs are (relax.engines.native.scoring),
    so the rollout must sample at 1."""
    if cfg.teacher.url and cfg.rollout.temperature != 1.0:
        raise ConfigError(f"teacher.url scores tokens at temperature 1 (SGLang's prompt log-probs ignore the sampling "
                          f"temperature) but rollout.temperature={cfg.rollout.temperature:g}: sample at 1, or use a "
                          f"local teacher (teacher.name_or_path), which scores at the rollout's temperature")


def check_distillation(cfg: Any) -> None:
    """On-policy distillation needs a teacher, and a teacher needs distillation: neither is accepted and ignored."""
    a, t = cfg.algorithm, cfg.teacher
    teacher = t.name_or_path or t.url
    if a.mode == "distill" and a.distill_coef == 0:
        raise ConfigError("algorithm.mode=distill trains on the distill term alone: set algorithm.distill_coef > 0 "
                          "(1.0 is the plain reverse KL)")
    if a.distill_coef > 0 and not teacher:
        raise ConfigError(f"algorithm.distill_coef={a.distill_coef:g} distils from a teacher: set teacher.name_or_path "
                          f"(a model folder or built-in name; teacher.checkpoint for trained weights) or teacher.url")
    if a.distill_topk and a.distill_coef == 0:
        raise ConfigError(f"algorithm.distill_topk={a.distill_topk} weights its KL to the teacher by "
                          f"algorithm.distill_coef, which is 0: set distill_coef > 0 or distill_topk=0")
    if teacher and a.distill_coef == 0:
        raise ConfigError(f"teacher {teacher!r} scores tokens nobody uses: set algorithm.distill_coef > 0 "
                          f"(and algorithm.mode=distill for distillation alone), or unset the teacher")
    if a.mode == "distill" and a.advantage == "gae":
        raise ConfigError("algorithm.mode=distill takes the distill term as the advantage: a critic (advantage=gae) "
                          "would train for nothing; use algorithm.advantage=grpo (unused in this mode)")
    if a.mode == "distill" and cfg.data.reward_role:
        raise ConfigError("algorithm.mode=distill trains without the reward, and data.reward_role=true gives it a "
                          "role of its own: set data.reward_role=false")


def check_overlong_buffer(cfg: Any) -> None:
    a = cfg.algorithm
    if a.overlong_buffer > cfg.rollout.max_new_tokens:
        raise ConfigError(f"algorithm.overlong_buffer ({a.overlong_buffer}) exceeds rollout.max_new_tokens "
                          f"({cfg.rollout.max_new_tokens}): the penalty ramps inside the length limit; lower it")


def check_reward_role(cfg: Any) -> None:
    if not cfg.data.reward_role:
        return
    clash = [name for name, on in (("rollout.dynamic_sampling", cfg.rollout.dynamic_sampling),
                                   ("rollout.env_fn", bool(cfg.rollout.env_fn)),
                                   ("algorithm.advantage=gae", cfg.algorithm.advantage == "gae")) if on]
    if clash:
        raise ConfigError(f"data.reward_role=true cannot run with {', '.join(clash)}: the rollout needs rewards "
                          f"as it generates (to filter groups, from the env) or the critic's stage expects them; "
                          f"turn those off or set data.reward_role=false")


def check_external_agents(cfg: Any) -> None:
    ro = cfg.rollout
    if ro.agents != "external":
        return
    clash = {"rollout.env_fn": "the agents are the environment", "data.reward_role=true": "a session is scored "
             "when it closes (the agent's reward, else the verifier)", "rollout.partial_rollout=abort": "weights "
             "change only between batches, never under an open session"}
    on = [k for k, v in (("rollout.env_fn", ro.env_fn), ("data.reward_role=true", cfg.data.reward_role),
                         ("rollout.partial_rollout=abort", ro.partial_rollout == "abort")) if v]
    if on:
        raise ConfigError(f"rollout.agents=external cannot run with {on[0]} ({clash[on[0]]}): unset it, or use "
                          f"rollout.agents=builtin")


def sglang_tp_size(cfg: Any) -> int:
    """GPUs per SGLang server: the rollout GPUs split evenly across ``rollout.num_engines`` (at least 1)."""
    return max(1, cfg.resources.rollout_gpus // max(1, cfg.rollout.num_engines))


def check_sglang_engine_gpus(cfg: Any) -> None:
    """An SGLang server runs on the GPUs its Ray actor holds: as many as its tensor-parallel size;
    stand-ins on CPU hold none."""
    ro = cfg.rollout
    per_server = sglang_tp_size(cfg)
    if (ro.engine == "sglang" and ro.engine_launcher == "ray" and ro.sglang_module == "sglang.launch_server"
            and ro.engine_gpus != per_server):
        raise ConfigError(f"rollout.engine_gpus={ro.engine_gpus:g} per Ray engine actor, but each SGLang server "
                          f"runs tensor parallel {per_server} (resources.rollout_gpus / rollout.num_engines): set "
                          f"rollout.engine_gpus={per_server}")


def check_partial_rollout_abort(cfg: Any) -> None:
    """partial_rollout=abort cuts generations by new weights: only where new weights can arrive mid-generation."""
    ro = cfg.rollout
    if ro.partial_rollout != "abort":
        return
    why = next((reason for applies, reason in (
        (cfg.topology == "colocated", "topology=colocated generates and trains in turn"),
        (cfg.queue.max_staleness == 0, "queue.max_staleness=0 makes each batch wait for its own weights"),
        (ro.engine != "native" or ro.engine_processes > 0,
         f"rollout.engine={ro.engine} with engine_processes={ro.engine_processes} serves over HTTP, and only "
         f"the in-process native engine aborts")) if applies), "")
    if why:
        raise ConfigError(f"rollout.partial_rollout=abort would change nothing here ({why}, so no generation is "
                          f"cut by new weights): use rollout.partial_rollout=wait, or abort with topology async "
                          f"or disaggregated, queue.max_staleness >= 1 and rollout.engine_processes=0")


def check_warm_started(cfg: Any) -> None:
    """The runtime does not warm-start (relax.pipeline does, before it): a config that reaches the runtime
    asking for one must come with its checkpoint. Not in CHECKS: the pipeline's own configs ask for one."""
    if cfg.trainer.sft_steps and not cfg.model.init_checkpoint:
        raise ConfigError(f"trainer.sft_steps={cfg.trainer.sft_steps} asks for a format warm-start, which the "
                          f"pipeline runs before RL: use `relax train`/`relax run` or relax.pipeline.train_run, "
                          f"or set trainer.sft_steps=0 (or model.init_checkpoint to a warm-start)")


def check_lora(cfg: Any) -> None:
    """``model.lora`` runs on the PyTorch backend with engines that load adapter versions (docs/lora.md)."""
    if cfg.model.lora.rank == 0:
        if cfg.model.lora.init_checkpoint:
            raise ConfigError("model.lora.init_checkpoint continues an adapter, but model.lora.rank=0 trains none: "
                              "set model.lora.rank to the adapter's rank")
        return
    if cfg.trainer.backend == "megatron":
        raise ConfigError("model.lora trains PEFT adapters on the PyTorch backend only (megatron-bridge's PEFT "
                          "needs transformer-engine on CUDA and transformers<5): set trainer.backend=torch or "
                          "model.lora.rank=0")
    t = cfg.trainer
    if t.freeze_encoders and 0 < t.thaw_encoders_at < t.total_steps:
        raise ConfigError(f"model.lora trains and publishes the adapter alone, so trainer.thaw_encoders_at="
                          f"{t.thaw_encoders_at} would train encoder weights that no weight version or checkpoint "
                          f"carries: set trainer.thaw_encoders_at=0 (under LoRA the encoders stay frozen) or "
                          f"model.lora.rank=0")
    if cfg.rollout.weight_sync == "broadcast":
        raise ConfigError("model.lora publishes adapter-only versions that engines merge onto their base; "
                          "rollout.weight_sync=broadcast sends whole models: set rollout.weight_sync=disk")
    if cfg.rollout.engine != "native":
        raise ConfigError(f"model.lora with rollout.engine={cfg.rollout.engine}: the rollout loads adapter versions "
                          f"into native engines only so far (SGLang servers take a PEFT folder by hand, docs/lora.md): "
                          f"set rollout.engine=native")
