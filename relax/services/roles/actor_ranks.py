"""The actor's training ranks: ``trainer.data_parallel x tensor_parallel x pipeline_parallel x
context_parallel`` processes that take every step together.

The actor role's own process is rank 0: it takes the step's batch from the queue, publishes and
checkpoints as a one-process actor does, and drives ranks 1..W-1 (``python -m
relax.services.roles.actor_ranks``, its children), which run each command on the same
arguments (SPMD): :class:`RankOps` is what every rank runs. Data-parallel ranks train on their
share of the batch (``Actor.share``), tensor-, pipeline- and context-parallel ranks on the same share
(megatron-core); publishing and saving gather the shards on every rank and rank 0 writes.

Commands travel by ``broadcast_object_list`` on a gloo group of their own (the objects are the
actor's: a batch, a URL; nothing read from storage), with no timeout, since a rank waits for
the next step as long as the rollout takes. Every command ends in a gather of each rank's
outcome, so a rank's error raises on rank 0 naming the rank; a rank that dies breaks the
group's connections, which raises there too; rank 0's own failure stops the others at once
(they cannot finish a collective without it), and they die with it (parent-death signal).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist

from relax.config import RelaxConfig, config_from_dict, config_to_dict
from relax.models import lora
from relax.services.launchers.lifetime import dying_with_owner
from relax.services.launchers.process import free_port
from relax.services.launchers.role_process import describe_exit
from relax.services.policy import build_actor_model
from relax.services.run_context import RunContext
from relax.trainers.checkpoint.files import CheckpointError
from relax.trainers.checkpoint.trainer_state import load_checkpoint, save_sharded_checkpoint, trainer_state
from relax.trainers.model_parallel import unwrap
from relax.trainers.torch.actor import Actor
from relax.trainers.torch.trainer import StepResult, wrap_ddp
from relax.transfer.adapter_versions import split

RANK_ENV, WORLD_ENV, PORT_ENV = "RELAX_ACTOR_RANK", "RELAX_ACTOR_WORLD", "RELAX_ACTOR_PORT"
NO_TIMEOUT = datetime.timedelta(days=365)
# errors a command raises on every rank alike before any collective (a checkpoint that fails its
# checks): rank 0 collects the others' outcomes as usual, then raises, and the group lives on
AGREED = (CheckpointError, FileNotFoundError)


class RankFailure(RuntimeError):
    """A training rank other than 0 failed a command (its error in the message)."""


def join_group(cfg: RelaxConfig, rank: int, world: int, port: int) -> dist.ProcessGroup:
    """The training process group (gloo on CPU, NCCL on CUDA; megatron's parallel state with the
    trainer's TP/PP sizes) and the command group; returns the latter."""
    t, cuda = cfg.trainer, torch.cuda.is_available()
    if dist.is_initialized():
        raise RuntimeError("this process already has a torch.distributed group (another megatron model or actor "
                           "built here first); a multi-rank actor must be the first model its process builds")
    if t.backend == "megatron" and not cuda:
        from relax.trainers.megatron.cpu import init_cpu_distributed

        init_cpu_distributed(rank, world, port, tp=t.tensor_parallel, pp=t.pipeline_parallel, cp=t.context_parallel,
                             ep=t.expert_parallel, seed=cfg.seed)
    else:
        if cuda:
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=world)
        if t.backend == "megatron":
            from megatron.core import parallel_state
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            parallel_state.initialize_model_parallel(t.tensor_parallel, t.pipeline_parallel,
                                                     context_parallel_size=t.context_parallel,
                                                     expert_model_parallel_size=t.expert_parallel)
            model_parallel_cuda_manual_seed(cfg.seed)
    # megatron 0.16 gathers with the name torch 2.13 deprecates, once per process and rank
    warnings.filterwarnings("ignore", category=FutureWarning, message=".*all_gather_into_tensor.*")
    return dist.new_group(backend="gloo", timeout=NO_TIMEOUT)


def leave_group() -> None:
    """Undo :func:`join_group` (megatron's parallel state too), so a rebuilt actor can join anew."""
    if "megatron.core" in sys.modules:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def parallel_model(model: torch.nn.Module, cfg: RelaxConfig, world: int) -> torch.nn.Module:
    """The model as the backend trains it: megatron-core's twin (sharded by the parallel state), or
    DistributedDataParallel for the PyTorch backend on several ranks, or the model itself."""
    if cfg.trainer.backend == "megatron":
        with warnings.catch_warnings():  # megatron announces every fused kernel it falls back from
            warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
            from relax.trainers.megatron.policy import megatron_policy

            return megatron_policy(model, seed=cfg.seed, routing_replay=cfg.algorithm.routing_replay,
                                   distributed_optimizer=cfg.trainer.distributed_optimizer)
    return wrap_ddp(model) if world > 1 else model


def megatron_beside_actor(cfg: RelaxConfig) -> bool:
    """Whether a reference or critic model built in this process runs on megatron-core (one
    process, tp=1): with ``trainer.backend=megatron``, unless this process is rank 0 of a
    multi-rank actor (the colocated topology), whose parallel state and data-parallel gradient
    averaging are the actor's; that reference or critic keeps the PyTorch backend."""
    return cfg.trainer.backend == "megatron" and not (dist.is_initialized() and dist.get_world_size() > 1)


class RankOps:
    """What each rank runs for a command; rank 0's results are the actor role's."""

    def __init__(self, ctx: RunContext, world: int):
        model, self.processor = build_actor_model(ctx)
        self.lora = ctx.cfg.model.lora.rank > 0
        self.actor = Actor(parallel_model(model, ctx.cfg, world), ctx.cfg, pad_id=ctx.tokenizer.pad_token_id or 0)
        self.ctx = ctx

    def train_step(self, batch: Any) -> StepResult:
        return self.actor.train_step(batch)

    def weights(self, with_base: bool = True) -> dict[str, torch.Tensor]:
        """The full weights in the Hugging Face layout (gathered over shards on every rank); a LoRA
        policy's adapter tensors instead, after its base's (``with_base``: a base version's)."""
        model = unwrap(self.actor.model)
        if self.lora:
            return {**(lora.base_state(model) if with_base else {}), **lora.adapter_state(model)}
        return model.state_dict()

    def load_weights(self, state: dict[str, torch.Tensor] | None = None, version: int | None = None) -> None:
        if state is None:  # each rank reads the version itself: a full state dict is not broadcast
            store = self.ctx.weights()
            try:
                state, _ = store.load(version)
            finally:
                store.close()
        if self.lora:  # the base is the one built beside it (build_actor_model)
            lora.load_adapter_state(unwrap(self.actor.model), split(state)[1], f"weight version {version}")
            return
        unwrap(self.actor.model).load_state_dict(state)

    def load_init(self, url: str) -> None:
        if not self.lora:  # a LoRA policy loaded it as its base when it was built
            load_checkpoint(url, self.actor.model, restore_rng=False)

    def resume(self, url: str) -> dict[str, Any]:
        return self.actor.trainer.load(url)

    def checkpoint_state(self) -> dict[str, Any]:
        t = self.actor.trainer
        return trainer_state(t.model, t.optimizer, t.scheduler)

    def save_sharded(self, url: str, meta: dict[str, Any]) -> None:
        """Write this rank's part of a sharded checkpoint; rank 0 then writes the rest (collective)."""
        t = self.actor.trainer
        save_sharded_checkpoint(url, t.model, t.optimizer, t.scheduler, meta)

    def stop(self) -> None:
        return None


class OneRank:
    """The actor as one process: :meth:`call` runs the method here."""

    world = 1

    def __init__(self, ctx: RunContext):
        self.ops = RankOps(ctx, 1)

    def call(self, op: str, *args: Any) -> Any:
        return getattr(RankOps, op)(self.ops, *args)

    def close(self) -> None:
        return None


def actor_ranks(ctx: RunContext) -> OneRank | ActorRanks:
    """The actor's processes for ``ctx``'s trainer layout."""
    world = ctx.cfg.trainer.actor_processes
    return ActorRanks(ctx, world) if world > 1 else OneRank(ctx)


class ActorRanks:
    """Rank 0's handle on the group: :meth:`call` runs a :class:`RankOps` method on every rank."""

    def __init__(self, ctx: RunContext, world: int):
        self.world, port = world, free_port("127.0.0.1")
        self.died: list[tuple[int, str]] = []  # the ranks found dead before this process killed the rest
        self.killed = False
        env = {**os.environ, WORLD_ENV: str(world), PORT_ENV: str(port), "PYTHONUNBUFFERED": "1"}
        config = json.dumps(config_to_dict(ctx.cfg))
        self.procs = []
        for rank in range(1, world):
            args = [sys.executable, "-m", "relax.services.roles.actor_ranks"]
            p = subprocess.Popen(dying_with_owner(args, os.getpid(), signal.SIGTERM),
                                 env={**env, RANK_ENV: str(rank)}, stdin=subprocess.PIPE, text=True)
            p.stdin.write(config)
            p.stdin.close()
            self.procs.append(p)
        try:
            self.control = join_group(ctx.cfg, 0, world, port)
            self.ops = RankOps(ctx, world)
        except BaseException:
            self.kill()
            raise

    def call(self, op: str, *args: Any) -> Any:
        try:
            return self._call(op, *args)
        except RuntimeError as e:
            # a rank that died breaks the group's connections: say which, not gloo's words
            dead = self.died if self.killed else self._wait_for_exit()  # once killed, all are dead
            if dead and not isinstance(e, RankFailure):
                rank, how = dead[0]
                raise RankFailure(f"actor rank {rank} of {self.world} died ({how}) during {op!r}; the actor "
                                  f"stops with its ranks (its supervisor restarts them)") from e
            raise

    def _wait_for_exit(self, timeout_s: float = 2.0) -> list[tuple[int, str]]:
        deadline = time.monotonic() + timeout_s  # the connection reset can be seen before the exit status
        while not self.dead() and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.dead()

    def dead(self) -> list[tuple[int, str]]:
        """(rank, how it ended) of the ranks 1..W-1 whose process has exited."""
        return [(rank, describe_exit(p.returncode)) for rank, p in enumerate(self.procs, start=1)
                if p.poll() is not None]

    def _call(self, op: str, *args: Any) -> Any:
        dist.broadcast_object_list([(op, args)], src=0, group=self.control)
        mine = None
        try:
            result = getattr(RankOps, op)(self.ops, *args)
        except AGREED as e:  # raised before any collective, alike on every rank (the same file)
            mine = e
        except BaseException:
            self.died = self._wait_for_exit(0.5)  # which rank took the group down, before the kill below
            self.kill()  # the others wait in a collective that cannot finish without this rank
            raise
        outcomes: list[Any] = [None] * self.world
        dist.gather_object(None, outcomes, dst=0, group=self.control)
        if mine is not None:
            raise mine
        failed = [(rank, err) for rank, err in enumerate(outcomes) if err]
        if failed:
            self.kill()
            rank, err = failed[0]
            raise RankFailure(f"actor rank {rank} of {self.world} failed {op!r}: {err}")
        return result

    def kill(self) -> None:
        self.killed = True
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()

    def close(self) -> None:
        """Stop the ranks (a clean exit when they still answer) and leave the group."""
        try:
            if all(p.poll() is None for p in self.procs):
                self.call("stop")
            for p in self.procs:
                p.wait(timeout=60)
        except Exception:  # noqa: BLE001 - a rank already gone: kill the rest
            pass
        finally:
            self.kill()
            leave_group()


def serve(cfg: RelaxConfig, rank: int, world: int, port: int) -> None:
    """A rank other than 0: join, build, then run rank 0's commands until ``stop``."""
    control = join_group(cfg, rank, world, port)
    ops = RankOps(RunContext(cfg), world)
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=control)
        op, args = box[0]
        try:
            getattr(RankOps, op)(ops, *args)
            outcome = None
        except Exception as e:  # noqa: BLE001 - reported to rank 0, which raises it
            outcome = f"{type(e).__name__}: {e}"
        dist.gather_object(outcome, None, dst=0, group=control)
        if op == "stop":
            break
    leave_group()


def main() -> None:
    cfg = config_from_dict(json.loads(sys.stdin.read()))
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")  # Apex/TE fallbacks, as rank 0
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ[WORLD_ENV])))
    serve(cfg, int(os.environ[RANK_ENV]), int(os.environ[WORLD_ENV]), int(os.environ[PORT_ENV]))


if __name__ == "__main__":
    main()
