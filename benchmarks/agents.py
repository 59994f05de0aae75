"""Learning through the session gateway: RL played by an external agent against the built-in agent loop.

Both runs start from the same part-taught policy (the tiny Qwen2 of ``tiny-cpu`` after supervised
steps on the ideal episodes of the ``tool_lookup`` training prompts, stopped where it looks the
item up but copies the code back only some of the time) and train the same steps: once with the
built-in agent loop (``rollout.agents=builtin``), once with every episode played by
``examples/tool_agent.py`` (a separate process speaking OpenAI's chat API, ``--parallel`` episodes
at once) through the gateway (``rollout.agents=external``). Held-out accuracy (greedy, built-in
evaluation) every ``--every`` steps, and the seconds a step takes in each (the ratio is the
gateway's cost on 2 cores: HTTP, chat templates and the agent's own work beside the trainer).

    python benchmarks/agents.py            # ~8 min on 2 cores
    python benchmarks/agents.py --api chat,responses,messages   # one external run per API the gateway serves
    python benchmarks/agents.py --quick --api responses,messages  # a smoke run of the code paths
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from output import Output, add_arguments

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: the tests' episode helper


from relax.config import load_config  # noqa: E402
from relax.config.preflight import AGENT_TOKEN_ENV  # noqa: E402
from relax.engines.guards import TOKEN_ENV  # noqa: E402
from relax.pipeline import evaluate, train_run  # noqa: E402
from relax.services.policy import build_model
from relax.services.run_context import RunContext  # noqa: E402
from relax.trainers.checkpoint.trainer_state import save_checkpoint  # noqa: E402
from tests.relax.services.tool_episodes import AGENT, teach_tool_use  # noqa: E402


def config(root: str, run_id: str, agents: str, args: argparse.Namespace):
    return load_config("tiny-cpu", [f"root={root}", f"run_id={run_id}", "data.tasks=[tool_lookup]",
                                    "data.train_per_task=256", "data.eval_per_task=64", "rollout.max_new_tokens=32",
                                    "rollout.max_turns=3", f"rollout.agents={agents}", "rollout.prompts_per_step=16",
                                    "rollout.n_samples_per_prompt=8", f"trainer.total_steps={args.steps}",
                                    f"trainer.checkpoint_every={args.every}", f"trainer.lr={args.lr}"])


SCRIPTS = {"chat": AGENT, "responses": AGENT.with_name("responses_agent.py"),
           "messages": AGENT.with_name("messages_agent.py")}  # the example agent of each API the gateway serves


def rl_run(root: str, agents: str, start: str, args: argparse.Namespace, api: str = "chat") -> dict:
    cfg = config(root, f"rl-{agents}" + (f"-{api}" if agents == "external" else ""), agents, args)
    player = None
    if agents == "external":
        run_dir = RunContext(cfg).run_url.removeprefix("file://")
        player = subprocess.Popen([sys.executable, str(SCRIPTS[api]), "--run-root", run_dir, "--forever",
                                   "--max-turns", "3", "--parallel", str(args.parallel), "--reconnect-s", "5"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    t0 = time.perf_counter()
    try:
        summary = train_run(cfg, init_checkpoint=start, progress=False)
    finally:
        if player is not None:
            player.wait(timeout=60)  # the gateway closes with the run; the agent stops by itself
    train_s = time.perf_counter() - t0
    curve = [
        {"step": s, "heldout": evaluate(cfg, f"{summary.run_url}/checkpoints/step-{s - 1:06d}").accuracy["tool_lookup"]}
        for s in range(args.every, args.steps + 1, args.every)
    ]
    rewards = [m["reward"] for m in sorted(summary.metrics("rollout"), key=lambda m: m["batch"])]
    name = agents if agents == "builtin" else f"external ({api})"
    return {"agents": name, "train_s": train_s, "s_per_step": train_s / args.steps, "curve": curve,
            "reward_first10": sum(rewards[:10]) / 10, "reward_last10": sum(rewards[-10:]) / 10}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sft-steps", type=int, default=330, help="supervised steps of 32 ideal episodes at lr 3e-3")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--every", type=int, default=25)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--parallel", type=int, default=32, help="episodes the external agent plays at once")
    ap.add_argument("--api", default="chat", help="comma-separated APIs the external agent speaks, one run each: "
                    "chat (examples/tool_agent.py), responses, messages")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 40 supervised and 4 RL steps (no docs)")
    add_arguments(ap)
    args = ap.parse_args()
    apis = args.api.split(",")
    if unknown := set(apis) - set(SCRIPTS):
        ap.error(f"--api: unknown {sorted(unknown)}; choose from {sorted(SCRIPTS)}")
    if args.quick:
        args.sft_steps, args.steps, args.every, args.parallel = 40, 4, 2, 16
    output = Output.from_args(args)
    os.environ.setdefault(TOKEN_ENV, "benchmark-engine-token")
    os.environ.setdefault(AGENT_TOKEN_ENV, "benchmark-agents-token")  # the gateway checks it, the agent sends it
    with tempfile.TemporaryDirectory() as tmp:
        root = f"file://{tmp}"
        ctx = RunContext(config(root, "sft", "builtin", args))
        model, _ = build_model(ctx)
        teach_tool_use(model, ctx.tokenizer, ctx.split("train"), steps=args.sft_steps, lr=3e-3, batch_size=32)
        start = save_checkpoint(f"{root}/part-taught", model, meta={"kind": "benchmark"})
        before = evaluate(ctx.cfg, start).accuracy["tool_lookup"]
        runs = [rl_run(root, "builtin", start, args)] + [rl_run(root, "external", start, args, api) for api in apis]
    builtin, external = runs[0], runs[1]
    result = {"setup": f"2-core CPU; tiny-cpu model, tool_lookup (256 train / 64 held-out prompts); {args.sft_steps} "
                       f"supervised steps, then {args.steps} RL steps of 16 prompts x 8 episodes at lr {args.lr:g}; "
                       f"external: the example agent of each API ({', '.join(apis)}) --parallel {args.parallel}",
              "heldout_before": before, "runs": runs,
              "step_time_ratio_external_to_builtin": external["s_per_step"] / builtin["s_per_step"]}
    result["step_time_ratios_to_builtin"] = {r["agents"]: r["s_per_step"] / builtin["s_per_step"] for r in runs[1:]}
    output.write_json("agents_quick" if args.quick else "agents", result)
    steps = [c["step"] for c in builtin["curve"]]
    rows = [f"Setup: {result['setup']}", "",
            "| agents | held-out before | " + " | ".join(f"step {s}" for s in steps) + " | s / step |",
            "|---|---|" + "---|" * len(steps) + "---|"]
    for r in runs:
        rows.append(f"| {r['agents']} | {before:.3f} | " + " | ".join(f"{c['heldout']:.3f}" for c in r["curve"])
                    + f" | {r['s_per_step']:.2f} |")
    rows.append("")
    ratios = ", ".join(f"{x:.2f}x ({name})" for name, x in result["step_time_ratios_to_builtin"].items())
    rows.append(f"A step through the gateway takes {ratios} the built-in one.")
    if not args.quick:
        output.table("agents", rows, "## Learning through the session gateway (`benchmarks/agents.py`)")
    print("\n".join(rows))
    print(json.dumps({"heldout_before": before, **{r["agents"]: r["curve"][-1]["heldout"] for r in runs},
                      "step_time_ratios_to_builtin": result["step_time_ratios_to_builtin"]}))


if __name__ == "__main__":
    main()
