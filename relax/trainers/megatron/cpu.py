"""megatron-core on a CPU: a gloo process group, megatron's parallel state, and every workaround
megatron-core 0.16.1 needs where it assumes CUDA (or Transformer Engine) in places that have nothing
to do with the math. This module is the only place that changes megatron's or torch's behaviour (the
numbers are docs/megatron.md's); the rest of the backend calls the context managers and initialisers
below. A temporary change swaps an attribute within a block and restores it however the block ends
(:func:`_patched`); the ones :func:`init_cpu_distributed` and :func:`building_gpt_model` install
last for the process.

1. ``tensor_parallel/random.py`` ``model_parallel_cuda_manual_seed`` calls
   ``torch.cuda.manual_seed`` and forks CUDA RNG states; we install the inference RNG
   tracker (``initialize_rng_tracker(inference_rng_tracker=True)``) whose ``fork`` is a no-op.
   Dropout is 0 here, so no RNG stream is lost.
2. ``utils.py`` ``GlobalMemoryBuffer.get_tensor`` allocates on ``torch.cuda.current_device()``
   (used by ``DotProductAttention`` for the ``baddbmm`` scores); we swap in a buffer that
   allocates on the CPU.
3. ``rotary_pos_embedding.py`` ``RotaryEmbedding.get_emb`` moves ``inv_freq`` to
   ``torch.cuda.current_device()`` on the first forward; we run it with that call
   answering "cpu".
4. ``transformer/utils.py`` ``get_default_causal_mask`` builds the mask with ``device="cuda"`` when
   ``attention_mask=None``: callers pass an explicit ``samples.causal_attention_mask`` (no patch).
5. ``tensor_parallel/mappings.py``'s gathers and reduce-scatters allocate their outputs on
   ``torch.cuda.current_device()``, in our forwards (:func:`forward_on_cpu`) and also inside
   autograd's backward (the expert-parallel token exchange: a gather's gradient is a reduce-scatter
   and back), where no block of ours is active; those functions are wrapped to run with that call
   answering "cpu".
6. The pipeline schedule's p2p code allocates on ``torch.cuda.current_device()`` and calls
   ``torch.cuda.synchronize()``, and ``schedules.py`` makes ``total_num_tokens`` with
   ``device="cuda"``: the schedule runs under :func:`megatron_calls_on_cpu` (see 9).
7. Tied embeddings at pipeline parallel > 1: megatron gives the last stage a copy of the embedding as
   ``output_layer.weight`` and, while building, all-reduces it over the embedding group after
   ``weight.data.cuda()`` (``language_module.py`` ``setup_embeddings_and_output_layer``); the build
   runs under :func:`megatron_calls_on_cpu` (:func:`building_gpt_model`), where ``.cuda()`` stays put.
8. MoE without Transformer Engine (on any device): ``moe_utils.py``'s router linear tests
   ``te_general_gemm is not None``, a name it only defines when TE imports; :func:`building_gpt_model`
   defines it as None.
9. Outside the model's own math megatron assumes CUDA in whole call paths: besides 6 and 7,
   ``DistributedDataParallel``, ``DistributedOptimizer`` and their norm/clip helpers allocate with
   ``device="cuda"``, call ``.cuda()`` and accept only parameters whose ``.type()`` is
   ``torch.cuda.FloatTensor``. :func:`megatron_calls_on_cpu` runs such a path with the current device
   "cpu", ``synchronize`` a no-op and a ``TorchFunctionMode`` that sends CUDA allocations to the CPU,
   keeps ``.cuda()`` in place and names a float tensor's type as its CUDA twin (no model code tests it).
10. ``rope_utils.py`` ``get_pos_emb_on_this_cp_rank`` (RoPE at context parallel > 1) builds its index
    with ``pin_memory=True``, which needs CUDA; the rotary module's name for it is replaced by the same
    selection on the embedding's own device.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.common.embeddings import rotary_pos_embedding
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.tensor_parallel import mappings
from megatron.core.tensor_parallel import random as mcore_random
from megatron.core.transformer.moe import moe_utils
from megatron.core.utils import GlobalMemoryBuffer
from torch.overrides import TorchFunctionMode

from relax.trainers.megatron.context_parallel import zigzag_positions


@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    """Within the block ``owner.<name>`` is ``value``; the original is restored however the block ends.
    Not thread-safe (it swaps a module attribute); meant for CPU processes that run one step at a time."""
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


@contextlib.contextmanager
def cuda_device_as_cpu() -> Iterator[None]:
    """Within the block, ``torch.cuda.current_device()`` answers "cpu" (workarounds 2, 3 and 5)."""
    with _patched(torch.cuda, "current_device", lambda: "cpu"):
        yield


def forward_on_cpu() -> contextlib.AbstractContextManager[None]:
    """Around a forward of megatron's model: without CUDA, :func:`cuda_device_as_cpu` (megatron's
    tensor-parallel gathers allocate on ``torch.cuda.current_device()``); nothing where CUDA exists."""
    return contextlib.nullcontext() if torch.cuda.is_available() else cuda_device_as_cpu()


class CpuGlobalMemoryBuffer(GlobalMemoryBuffer):
    """megatron's scratch-buffer pool, allocating on the CPU (workaround 2)."""

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):  # type: ignore[override]
        with cuda_device_as_cpu():
            return super().get_tensor(tensor_shape, dtype, name, mem_alloc_context)


def _run_on_cpu(owner: Any, names: tuple[str, ...]) -> None:
    """Replace each ``owner.<name>`` (a module's function or a class's method) by one that runs with
    ``torch.cuda.current_device()`` answering "cpu" (workarounds 3 and 5); idempotent, a no-op when
    CUDA exists. Callers look these names up at call time, autograd's backward included."""
    if torch.cuda.is_available():
        return
    for name in names:
        fn = getattr(owner, name)
        if not getattr(fn, "_relax_cpu", False):
            setattr(owner, name, _on_cpu(fn))


def _on_cpu(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with cuda_device_as_cpu():
            return fn(*args, **kwargs)

    wrapped._relax_cpu = True  # type: ignore[attr-defined]
    return wrapped


def _pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group: Any) -> torch.Tensor:
    """megatron's zigzag selection of this context rank's RoPE rows, on ``pos_emb``'s device (workaround 10)."""
    held = zigzag_positions(pos_emb.shape[seq_dim], cp_group.size(), cp_group.rank(), pos_emb.device)
    return pos_emb.index_select(seq_dim, held)


class _CudaAsCpu(TorchFunctionMode):
    """Workaround 7: ``device="cuda"`` (or an index) becomes the CPU, ``.cuda()`` stays put, and
    ``.type()`` names a CPU float tensor as its CUDA twin (megatron's optimizers check that name)."""

    _CUDA_TYPES = {f"torch.{t}Tensor": f"torch.cuda.{t}Tensor" for t in ("Float", "Half", "BFloat16")}

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and (isinstance(device, int) or torch.device(device).type == "cuda"):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return self._CUDA_TYPES.get(name, name)
        return func(*args, **kwargs)


@contextlib.contextmanager
def megatron_calls_on_cpu() -> Iterator[None]:
    """Run a megatron call path that assumes CUDA (workarounds 6, 7 and 9: the pipeline schedule, DDP and the
    distributed optimizer, a tied stage's build) on a CPU; a no-op where CUDA exists."""
    if torch.cuda.is_available():
        yield
        return
    with cuda_device_as_cpu(), _patched(torch.cuda, "synchronize", lambda *a, **k: None), _CudaAsCpu():
        yield


@contextlib.contextmanager
def building_gpt_model(moe: bool, tied_stages: bool) -> Iterator[None]:
    """Around ``GPTModel(...)``: workaround 8 for an MoE model (``moe``), and workaround 7 for a tied
    embedding split over pipeline stages (``tied_stages``; a no-op where CUDA exists)."""
    if moe and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # workaround 8
    with megatron_calls_on_cpu() if tied_stages else contextlib.nullcontext():  # workaround 7
        yield


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_cpu_distributed(
    rank: int = 0,
    world_size: int = 1,
    port: int | None = None,
    *,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    ep: int = 1,
    seed: int = 1234,
) -> None:
    """gloo process group + megatron parallel state + the CPU workarounds, for one rank.

    With world_size > 1 every rank must pass the same ``port``.
    """
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port if port is not None else free_port())
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
    )
    mcore_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)  # workaround 1
    parallel_state._GLOBAL_MEMORY_BUFFER = CpuGlobalMemoryBuffer()  # workaround 2
    _run_on_cpu(RotaryEmbedding, ("get_emb",))  # workaround 3
    _run_on_cpu(mappings, ("_gather_along_first_dim", "_gather_along_last_dim",
                           "_reduce_scatter_along_first_dim"))  # workaround 5
    if not torch.cuda.is_available():
        rotary_pos_embedding.get_pos_emb_on_this_cp_rank = _pos_emb_on_this_cp_rank  # workaround 10
    torch.manual_seed(seed)


def init_cpu_single_process(tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, seed: int = 1234) -> None:
    """World size 1 on gloo (127.0.0.1, a free port); megatron then accepts only sizes of 1."""
    init_cpu_distributed(0, 1, None, tp=tp, pp=pp, cp=cp, ep=ep, seed=seed)


def shutdown_distributed() -> None:
    """Undo ``init_cpu_*``: megatron's global parallel state and the process group."""
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


