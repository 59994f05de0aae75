"""Training backends for Relax's actor (policy) updates.

Each backend lives in its own subpackage so that its heavy, optional dependencies
(megatron-core, CUDA kernels) are imported only by code that asks for that backend.
"""
