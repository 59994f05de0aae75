"""Generative reward model: a trained tiny judge, its judging throughput, and RL graded by it.

1. The judge: a tiny Qwen2 trained to say yes / no to ``--task`` answers
   (relax.trainers.torch.judge_sft), cached in the results folder under a key of its settings, so
   a rerun skips it; its held-out agreement with the task's verifier is measured through the real
   ``GenRMJudge`` (yes/no read from the first token's log-probs, as a run reads it).
2. ``batched_vs_per_sample``: judgements/s of the reward role's path (``GenRMJudge`` over
   ``RemoteEngines``: one batched ``/generate`` per engine) against one OpenAI chat request per
   sample to the same native engine server (``relax.rollout.judge.JudgeReward``, ``max_tokens=1``,
   its default concurrency), the same pairs, alternated, median of ``--repeats``.
3. ``scale_out_speedup``: judgements/s of the batched path with 2 judge engine processes over 1.
4. Learning: the ``omni-cpu`` recipe on the text task alone, rewarded by the judge
   (``data.reward_role=true genrm.name_or_path=<judge>``) and, for comparison, by the verifier;
   held-out accuracy by the verifier (greedy) before -> after, and the judge's agreement with the
   verifier on the GenRM run's own rollouts (the reward role's ``genrm/...`` metrics).

    python benchmarks/genrm.py [--quick] [--update-docs]

Last line: one JSON object with ``judge_accuracy``, ``batched_vs_per_sample``, ``scale_out_speedup``
and ``learning`` (per reward: held-out before / after).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import tempfile
import time

from output import Output, add_arguments

from relax.trainers.torch import judge_sft


def judge_folder(args: argparse.Namespace, output: Output) -> tuple[str, dict]:
    """The trained judge (cached by its settings) and its record: training figures and held-out accuracy."""
    settings = {"task": args.task, "steps": args.judge_steps, "seed": args.seed, "size": judge_sft.JUDGE_SIZE,
                "recipe": judge_sft.JUDGE_RECIPE}
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    folder = output.folder / "genrm_judges" / key
    record_path = folder / "judge_record.json"
    if record_path.is_file():
        print(f"judge: cached at {folder}", flush=True)
        return str(folder), json.loads(record_path.read_text())
    def progress(step: int, loss: float) -> None:
        if step % 50 == 0 or step == args.judge_steps - 1:
            print(f"judge: step {step}, loss {loss:.4f}", flush=True)

    trained = judge_sft.train_judge(str(folder), args.task, args.judge_steps, seed=args.seed, progress=progress)
    judge = judge_sft.local_judge(str(folder), seed=args.seed)
    try:
        held_out = judge_sft.judge_accuracy(judge, args.task, args.eval, seed=args.seed)
    finally:
        judge.close()
    record = {**settings, "train_s": trained["train_s"], "loss_first": trained["loss_first"],
              "loss_last": trained["loss_last"], "held_out": held_out}
    record_path.write_text(json.dumps(record, indent=1))
    print(f"judge: trained {args.judge_steps} steps in {trained['train_s']:.0f} s, held-out {held_out}", flush=True)
    return str(folder), record


def judge_pairs(args: argparse.Namespace) -> list:
    import random

    from relax.data.suite import TASKS
    from relax.data.suite.base import derive_seed

    samples = TASKS[args.task].generate(args.seed, "eval", args.pairs // 2, 1)
    return [(d.response, d.sample) for d in judge_sft.judge_demos(samples, random.Random(derive_seed(args.seed, "b")))]


def throughput(folder: str, pairs: list, repeats: int, log_dir: str) -> dict:
    """Judgements/s of the batched path with 1 and 2 engine processes and of one HTTP request per sample."""
    from relax.engines.guards import ensure_token
    from relax.models import build_tokenizer
    from relax.rollout.genrm import GenRMJudge
    from relax.rollout.judge import JudgeReward
    from relax.rollout.remote_engines import RemoteEngines
    from relax.services.launchers.process import LocalProcessLauncher

    tok = build_tokenizer(folder)
    token = ensure_token()
    launcher = LocalProcessLauncher(folder, max_engines=2, max_batch_size=len(pairs), log_dir=log_dir, api_token=token)
    engines = launcher.launch(2)
    spec = judge_sft.local_spec(folder)
    # the per-sample judge sends the same prompt (JudgeReward's template names the reference {answer}) and
    # lets the judge write as many tokens: the same work per judgement, asked one sample per request
    per_sample = JudgeReward(engines[0].url, template=spec.template.replace("{reference}", "{answer}"),
                             max_tokens=spec.max_new_tokens if spec.verdict != "yes_no" else 1, api_key=token)
    ids = [f"b{i}" for i in range(len(pairs))]
    times: dict[str, list[float]] = {"batched_1": [], "per_sample_1": [], "batched_2": []}
    pools = {n: RemoteEngines([e.url for e in engines[:n]], vocab_size=len(tok)) for n in (1, 2)}
    judges = {n: GenRMJudge(pool, tok, spec, {}) for n, pool in pools.items()}
    try:
        for n in (1, 2):
            judges[n].score_many(pairs[:8], ids[:8])  # warm: connections, first forward
        answered = per_sample.many(pairs[:8])
        # each per-sample request must reach the engine and come back with its text (JudgeReward reads
        # <score> tags, so a boxed verdict comes back as its JudgeError quoting the text: still a judgement)
        unreached = [a for a in answered if isinstance(a, BaseException) and "answer has no" not in str(a)]
        assert not unreached, unreached[0]
        for _ in range(repeats):
            for name, run in (("batched_1", lambda: judges[1].score_many(pairs, ids)),
                              ("per_sample_1", lambda: per_sample.many(pairs)),
                              ("batched_2", lambda: judges[2].score_many(pairs, ids))):
                t0 = time.perf_counter()
                out = run()
                times[name].append(time.perf_counter() - t0)
                assert len(out) == len(pairs)
    finally:
        for pool in pools.values():
            pool.close()
        for e in engines:
            e.stop()
    rate = {k: len(pairs) / statistics.median(v) for k, v in times.items()}
    return {"pairs": len(pairs), "repeats": repeats, "judgements_per_s": rate, "seconds": times,
            "batched_vs_per_sample": rate["batched_1"] / rate["per_sample_1"],
            "scale_out_speedup": rate["batched_2"] / rate["batched_1"]}


def learning_run(args: argparse.Namespace, root: str, reward: str, judge: str) -> dict:
    """The omni-cpu recipe on ``--task`` alone, rewarded by ``reward`` (genrm: the judge; verifier: the task's
    verifier), in the reward role either way; held-out greedy accuracy by the verifier before and after."""
    from relax.config import load_config
    from relax.pipeline import evaluate, train_run, warm_start
    from relax.services.report.metrics import read_all_metrics
    from relax.services.run_context import RunContext

    extra = judge_sft.judge_overrides(judge) if reward == "genrm" else []
    cfg = load_config("omni-cpu", [f"root={root}", f"run_id=genrm-{reward}", f"data.tasks=[{args.task}]",
                                   f"data.eval_per_task={args.eval}", f"trainer.total_steps={args.steps}",
                                   f"trainer.checkpoint_every={args.steps}", "data.reward_role=true",
                                   f"seed={args.seed}", *(["trainer.sft_steps=2"] if args.quick else []),
                                   *extra, *args.overrides])
    init = warm_start(cfg, RunContext(cfg).snapshot_info.id)
    before = evaluate(cfg, init).accuracy[args.task]
    t0 = time.perf_counter()
    summary = train_run(cfg, init_checkpoint=init, progress=False)
    train_s = time.perf_counter() - t0
    after = evaluate(cfg, f"{summary.run_url}/checkpoints/step-{args.steps - 1:06d}").accuracy[args.task]
    scored = read_all_metrics(summary.run_url).get("reward", [])
    agreement = rollout_agreement(cfg, args.task) if reward == "genrm" else None
    every = max(1, len(scored) // 10)
    curve = [{"step": m["step"], "reward": m["reward"], "invalid": m.get("genrm/invalid", 0.0)}
             for m in scored[::every]]
    print(f"{reward}: {args.steps} steps in {train_s:.0f} s, held-out {before:.3f} -> {after:.3f}", flush=True)
    return {"reward": reward, "steps": args.steps, "train_s": train_s, "before": before, "after": after,
            "samples_per_step": cfg.rollout.prompts_per_step * cfg.rollout.n_samples_per_prompt,
            "reward_first": summary.reward_first, "reward_last": summary.reward_last,
            "invalid_total": scored[-1].get("genrm/unparsable_total", 0.0) if scored else 0.0, "reward_curve": curve,
            "rollout_agreement": agreement}


def rollout_agreement(cfg, task: str, chunks: int = 4) -> list[dict]:
    """The judge's verdict (reward > 0.5) against the task's verifier on the run's own rollouts still in its queue,
    in ``chunks`` spans of commit order (early to late): what the policy was rewarded for."""
    from relax.data.suite import TASKS
    from relax.services.run_context import RunContext
    from relax.transfer.queue import TransferQueue

    q = TransferQueue(cfg.root, cfg.run_id, "rollouts")
    q.refresh()
    ids = [sid for sid, meta in q.state.samples.items() if "reward" in meta.locs]  # scored rows
    rows = q.read(ids, ["response", "reward"])
    samples = {s.id: s for s in RunContext(cfg).split("train")}
    spans = []
    size = max(1, len(ids) // chunks)
    for start in range(0, size * chunks, size):
        cells = {"judge_yes_correct": 0, "judge_yes_wrong": 0, "judge_no_correct": 0, "judge_no_wrong": 0}
        for sid, response, reward in zip(ids[start:start + size], rows["response"][start:start + size],
                                         rows["reward"][start:start + size], strict=True):
            correct = TASKS[task].reward(str(response), samples[sid.rsplit("@", 1)[0]]) > 0.5
            cells[f"judge_{'yes' if float(reward) > 0.5 else 'no'}_{'correct' if correct else 'wrong'}"] += 1
        n = sum(cells.values())
        spans.append({**cells, "rows": n, "agreement": (cells["judge_yes_correct"] + cells["judge_no_wrong"]) / n,
                      "verifier_accuracy": (cells["judge_yes_correct"] + cells["judge_no_correct"]) / n})
    return spans


def write_table(result: dict, output: Output) -> None:
    j, t = result["judge"], result["throughput"]
    rate = t["judgements_per_s"]
    rows = [f"Setup: {result['setup']}", "",
            "| measure | value |", "|---|---|",
            f"| judge held-out agreement with the verifier ({int(j['held_out']['pairs'])} pairs, chance 0.5) | "
            f"{j['held_out']['accuracy']:.3f} |",
            f"| judge training ({j['steps']} SFT steps) | {j['train_s']:.0f} s |",
            f"| batched, 1 engine (GenRMJudge over RemoteEngines) | {rate['batched_1']:.1f} judgements/s |",
            f"| one HTTP request per sample, same engine (JudgeReward) | {rate['per_sample_1']:.1f} judgements/s |",
            f"| **batched_vs_per_sample** | **{t['batched_vs_per_sample']:.2f}x** |",
            f"| batched, 2 engines | {rate['batched_2']:.1f} judgements/s |",
            f"| **scale_out_speedup** (2 engines / 1) | **{t['scale_out_speedup']:.2f}x** |", "",
            "| reward | held-out before | held-out after | mean reward first -> last step | train time |",
            "|---|---|---|---|---|"]
    for r in result["runs"]:
        rows.append(f"| {r['reward']} | {r['before']:.3f} | {r['after']:.3f} | {r['reward_first']:.3f} -> "
                    f"{r['reward_last']:.3f} | {r['train_s'] / 60:.1f} min |")
    for r in result["runs"]:
        if r.get("rollout_agreement"):
            rows += ["", f"The {r['reward']} run's own rollouts, graded afterwards by the verifier (commit order):", "",
                     "| rollouts | verifier accuracy (sampled) | judge yes on correct | judge yes on wrong | "
                     "agreement |", "|---|---|---|---|---|"]
            for i, a in enumerate(r["rollout_agreement"]):
                yes_c = a["judge_yes_correct"] / max(1, a["judge_yes_correct"] + a["judge_no_correct"])
                yes_w = a["judge_yes_wrong"] / max(1, a["judge_yes_wrong"] + a["judge_no_wrong"])
                rows.append(f"| quarter {i + 1} ({a['rows']} rows) | {a['verifier_accuracy']:.3f} | {yes_c:.3f} | "
                            f"{yes_w:.3f} | {a['agreement']:.3f} |")
    output.table("genrm", rows, "## Generative reward model (`benchmarks/genrm.py`, results/genrm.json)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a few steps of everything: checks the script")
    ap.add_argument("--task", default="largest", help="a built-in text task (largest, arithmetic)")
    ap.add_argument("--judge-steps", type=int, default=judge_sft.TRAIN_STEPS)
    ap.add_argument("--pairs", type=int, default=160, help="judgements per timed batch (a step's 20 x 8 rows)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=400, help="RL steps of each learning run")
    ap.add_argument("--eval", type=int, default=128, help="held-out prompts")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rewards", nargs="+", default=["genrm", "verifier"], choices=["genrm", "verifier"])
    ap.add_argument("overrides", nargs="*", help="extra config overrides key=value for the learning runs")
    add_arguments(ap)
    args = ap.parse_args()
    if args.quick:
        args.judge_steps, args.pairs, args.repeats, args.steps, args.eval = 4, 16, 1, 2, 8
    output = Output.from_args(args)
    folder, judge = judge_folder(args, output)
    with tempfile.TemporaryDirectory() as tmp:
        speed = throughput(folder, judge_pairs(args), args.repeats, tmp)
        print(f"throughput: {speed['judgements_per_s']}", flush=True)
        runs = [learning_run(args, f"file://{tmp}/{r}", r, folder) for r in args.rewards]
    result = {
        "quick": args.quick,
        "task": args.task,
        "judge": judge,
        "throughput": speed,
        "runs": runs,
        "judge_accuracy": judge["held_out"]["accuracy"],
        "batched_vs_per_sample": speed["batched_vs_per_sample"],
        "scale_out_speedup": speed["scale_out_speedup"],
        "learning": {r["reward"]: {"before": r["before"], "after": r["after"]} for r in runs},
        "setup": (f"2-core CPU shared with other jobs; task {args.task}; judge tiny Qwen2 "
                  f"{judge_sft.JUDGE_SIZE['hidden_size']} wide x {judge_sft.JUDGE_SIZE['num_layers']} layers "
                  f"(bpe-tiny), {judge['steps']} SFT steps; throughput: {speed['pairs']} judgements per batch, "
                  f"median of {speed['repeats']}, native engine processes; learning: omni-cpu recipe on "
                  f"{args.task} alone, reward role, {args.steps} steps x {runs[0]['samples_per_step'] if runs else 0}"
                  f" samples, greedy held-out accuracy by the verifier on {args.eval} prompts"),
    }
    output.write_json("genrm_quick" if args.quick else "genrm", result, indent=1)
    if not args.quick:
        write_table(result, output)
    print(json.dumps({k: result[k] for k in ("judge_accuracy", "batched_vs_per_sample", "scale_out_speedup",
                                             "learning")}))


if __name__ == "__main__":
    main()
