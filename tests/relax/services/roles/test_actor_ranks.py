"""The actor as several processes in the RL loop (relax.services.roles.actor_ranks).

``trainer.data_parallel`` (the PyTorch backend's DDP) and ``trainer.tensor_parallel``,
``pipeline_parallel`` or ``context_parallel`` (the Megatron backend) start that many training ranks; their first update
equals the one-process
actor's on the same batch. A multi-rank actor killed mid-run is restarted with its ranks, and a
run checkpointed at tensor parallel 2 resumes at 1. Each run is ``relax train`` in a process of
its own (a colocated driver would hold the actor's process group and megatron's state).

The reward is ``length_reward``, which varies inside every prompt group, so every step has
non-zero advantages and a real gradient to compare.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from relax.services.report.metrics import read_metrics
from relax.transfer.weights import WeightStore
from tests.polling import wait_until

REPO = Path(__file__).resolve().parents[4]
pytestmark = [pytest.mark.slow]

COMMON = ("data.tasks=[arithmetic]", "data.train_per_task=64", "data.eval_per_task=8", "rollout.prompts_per_step=4",
          "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=8", "trainer.checkpoint_every=1",
          "data.reward_fn=tests.relax.services.runtime_helpers.length_reward", "trainer.lr=1e-3",
          "queue.max_staleness=1", "queue.exact_staleness=true", "supervisor.backoff_s=0.1")


def _train(root: Path, *overrides: str, fault: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    env.pop("RELAX_FAULT", None)
    if fault:
        env["RELAX_FAULT"] = fault
    proc = subprocess.run([sys.executable, "-m", "relax.cli.main", "train", "tiny-cpu", *COMMON, f"root=file://{root}",
                           "run_id=ranks", *overrides, "--no-progress"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def _actor(root: Path) -> list[dict]:
    return sorted(read_metrics(f"file://{root}/runs/ranks", "actor"), key=lambda m: (m["step"], m.get("attempt", 0)))


def _version(root: Path, v: int) -> dict[str, torch.Tensor]:
    return WeightStore(f"file://{root}", "ranks").load(v)[0]


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("one")
    _train(root, "trainer.total_steps=2")
    return root


def test_data_parallel_2_takes_the_one_process_step(one_process: Path, tmp_path: Path) -> None:
    _train(tmp_path, "trainer.total_steps=2", "trainer.data_parallel=2")
    one, two = _actor(one_process)[0], _actor(tmp_path)[0]
    assert (one["ranks"], two["ranks"]) == (1, 2)
    assert one["grad_norm"] > 0.01  # a real gradient
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    assert two["loss"] == pytest.approx(one["loss"], abs=1e-6)
    assert _max_diff(_version(one_process, 1), _version(tmp_path, 1)) < 1e-5
    assert _max_diff(_version(one_process, 0), _version(one_process, 1)) > 1e-4  # the step moved the weights


@pytest.mark.parametrize("layout", ["pipeline_parallel", "context_parallel"])
def test_megatron_pipeline_or_context_parallel_2_takes_the_one_process_step(one_process: Path, tmp_path: Path,
                                                                            layout: str) -> None:
    pytest.importorskip("megatron.core", exc_type=ImportError)
    # step 1 trains on rows sampled by version 0 and 1 (max_staleness=1): the proximal log-probs
    # are recomputed through the pipeline's forward-only schedule, or by both context ranks' halves
    # context ranks hold the same weights: a sharded checkpoint gets one part, from context rank 0
    sharded = ("trainer.checkpoint_format=sharded",) if layout == "context_parallel" else ()
    _train(tmp_path, "trainer.total_steps=2", "trainer.backend=megatron", f"trainer.{layout}=2", *sharded)
    if sharded:
        folders = sorted((tmp_path / "runs/ranks/checkpoints").glob("step-*/shards"))
        assert len(folders) == 2 and all([p.name for p in f.iterdir()] == ["tp0-pp0-ep0.pt"] for f in folders)
    one, two = _actor(one_process), _actor(tmp_path)
    assert [m["ranks"] for m in two] == [2, 2]
    assert two[0]["grad_norm"] == pytest.approx(one[0]["grad_norm"], rel=1e-5)
    assert _max_diff(_version(one_process, 1), _version(tmp_path, 1)) < 1e-5
    assert two[1]["grad_norm"] == pytest.approx(one[1]["grad_norm"], rel=1e-5)


def test_megatron_tp2_actor_heals_a_kill_and_resumes_at_tp1(one_process: Path, tmp_path: Path) -> None:
    pytest.importorskip("megatron.core", exc_type=ImportError)
    tp2 = ("trainer.backend=megatron", "trainer.tensor_parallel=2", "topology=disaggregated",
           "trainer.checkpoint_format=sharded")
    # rank 0 is SIGKILLed as it takes step 1; its rank 1 dies with it; the controller restarts both, and
    # each rank reads its own part of the step-0 checkpoint back
    _train(tmp_path, "trainer.total_steps=3", *tp2, fault="actor:step:1:1")
    steps = _actor(tmp_path)
    assert {m["step"] for m in steps} == {0, 1, 2} and all(m["ranks"] == 2 for m in steps)
    status = json.loads(subprocess.run([sys.executable, "-m", "relax.cli.main", "status", f"file://{tmp_path}",
                                        "ranks", "--json"], cwd=REPO, capture_output=True, text=True).stdout)
    assert status["restarts"]["actor"] == 1
    # the megatron tp=2 update of the same batch is the PyTorch one-process update
    assert steps[0]["grad_norm"] == pytest.approx(_actor(one_process)[0]["grad_norm"], rel=1e-5)
    assert _max_diff(_version(one_process, 1), _version(tmp_path, 1)) < 1e-5
    ckpts = tmp_path / "runs" / "ranks" / "checkpoints"
    assert all(sorted(p.name for p in (c / "shards").iterdir()) == ["tp0-pp0-ep0.pt", "tp1-pp0-ep0.pt"]
               for c in ckpts.iterdir())
    # the same run resumed at tensor parallel 1 (the parts consolidated) takes its next step
    _train(tmp_path, "trainer.total_steps=4", "trainer.backend=megatron", "topology=disaggregated")
    last = _actor(tmp_path)[-1]
    assert (last["step"], last["ranks"]) == (3, 1) and last["grad_norm"] > 0
    assert 4 in WeightStore(f"file://{tmp_path}", "ranks").versions()


def test_a_killed_training_rank_stops_its_actor_which_is_restarted_with_all_its_ranks(tmp_path: Path) -> None:
    # SIGKILL rank 1 of a data-parallel 2 actor mid-run (disaggregated): rank 0's next collective fails, the
    # actor role exits naming the dead rank, and the supervisor restarts it; the run finishes
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    env.pop("RELAX_FAULT", None)
    run = subprocess.Popen([sys.executable, "-m", "relax.cli.main", "train", "tiny-cpu", *COMMON,
                            f"root=file://{tmp_path}", "run_id=ranks", "trainer.total_steps=12",
                            "trainer.data_parallel=2", "topology=disaggregated", "--no-progress"],
                           cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def stepped_twice() -> bool:
            assert run.poll() is None, run.communicate()[0][-3000:]
            return any(m["step"] >= 2 for m in _actor_records(tmp_path))

        wait_until(stepped_twice, 300, interval=0.2, what="the actor's step 2")
        [worker] = _rank_processes(run.pid)
        os.kill(worker, signal.SIGKILL)
        out = run.communicate(timeout=600)[0]
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, out[-3000:]
    assert "actor rank 1 of 2 died (signal 9 (SIGKILL))" in out
    steps = _actor(tmp_path)
    assert {m["step"] for m in steps} == set(range(12))
    assert len({m["attempt"] for m in steps}) == 2  # the second incarnation finished the run


def _actor_records(root: Path) -> list[dict]:
    try:
        return read_metrics(f"file://{root}/runs/ranks", "actor")
    except FileNotFoundError:
        return []


def _rank_processes(ancestor: int) -> list[int]:
    """Pids of actor rank processes (``python -m relax.services.roles.actor_ranks``) under ``ancestor``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"relax.services.roles.actor_ranks" in cmd and _descends(int(pid), ancestor):
            found.append(int(pid))
    return found


def _descends(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return False
    return False


RANK0_FAILS = r"""
import sys
from relax.config import load_config
from relax.services.run_context import RunContext
from relax.services.roles.actor_ranks import ActorRanks, RankFailure
import torch

ctx = RunContext(load_config("tiny-cpu", [f"root=file://{sys.argv[1]}", "data.tasks=[arithmetic]",
                                          "trainer.data_parallel=2"]))
ranks = ActorRanks(ctx, 2)
try:
    ranks.call("load_weights", {"not.a.weight": torch.zeros(1)})  # fails on every rank, rank 0 first
except RankFailure as e:
    print("MISREPORTED", e)
except Exception as e:
    print("RAISED", type(e).__name__, str(e)[:200])
print("DEAD", ranks.dead())
ranks.close()
"""


def test_rank_0s_own_error_is_raised_as_itself_not_as_the_death_of_the_ranks_it_stopped(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    out = subprocess.run([sys.executable, "-c", RANK0_FAILS, str(tmp_path)], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300).stdout
    assert "MISREPORTED" not in out, out
    assert "RAISED RuntimeError Error(s) in loading state_dict" in out, out  # the load that failed, as it failed
    assert "DEAD [(1, 'signal 9 (SIGKILL)')]" in out  # rank 0 stopped the other rank, which could not finish


def test_a_lora_actor_on_two_ranks_takes_the_one_process_steps(tmp_path: Path) -> None:
    """LoRA under DDP: both runs start from the same adapter (seeded, whatever a rank did before), and
    the second step's KL against the adapter-off reference, which rank 0 computes for the whole batch
    and every rank trains with, makes the same loss as on one process."""
    lora = ("trainer.total_steps=2", "model.lora.rank=4", "model.lora.alpha=8", "trainer.lr=0.05",
            "trainer.warmup_steps=0", "algorithm.kl_coef=0.5", "algorithm.kl_estimator=k3")
    one, two = tmp_path / "one", tmp_path / "two"
    _train(one, *lora)
    _train(two, *lora, "trainer.data_parallel=2")
    a, b = _actor(one), _actor(two)
    assert [m["ranks"] for m in a + b] == [1, 1, 2, 2]
    assert a[0]["grad_norm"] > 0.01 and b[0]["grad_norm"] == pytest.approx(a[0]["grad_norm"], rel=1e-5)
    assert a[1]["kl_sampled_token_max"] > 1e-3  # the policy moved away from its adapter-off reference
    assert b[1]["loss"] == pytest.approx(a[1]["loss"], rel=1e-3)
    assert b[1]["grad_norm"] == pytest.approx(a[1]["grad_norm"], rel=1e-4)
    v0, v2 = _version(one, 0), _version(one, 2)
    assert set(v2) == {k for k in v0 if ".lora_" in k}  # adapter-only versions
    moved = _max_diff(v2, {k: v0[k] for k in v2})
    assert moved > 1e-2 and _max_diff(_version(two, 2), v2) < 1e-2 * moved
