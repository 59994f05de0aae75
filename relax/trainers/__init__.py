"""Training backends: PyTorch (``relax.trainers.torch``) and Megatron-core (``relax.trainers.megatron``).

Each backend lives in its own subpackage so that its heavy, optional dependencies
(megatron-core, CUDA kernels) are imported only by code that asks for that backend.
"""
