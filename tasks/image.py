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

Both take the package list from pyproject.toml's ``[project].dependencies``, the one place it is
written: the Dockerfile ``pip install .``-s the project, the spec reads the list (with torch and
megatron-core pinned), so neither can drift from what ``make setup`` installs.

Why the registry switch: flytekit builds an ImageSpec while *serializing* a task that names one,
so an always-on spec would make every ``pyflyte package`` try to run a container build. Constructing
the spec (importing this module) never builds or pulls anything.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from flytekit import ImageSpec

TORCH = "torch==2.13.0"  # within pyproject's torch range (tests/tasks/test_image.py checks it)
MEGATRON = "megatron-core==0.16.1"  # newest for Python 3.11 (STACK.md); 0.17+ needs 3.12
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _toml_string_array(text: str, table: str, key: str) -> list[str]:
    """The strings of ``key = [...]`` in ``[table]``: enough TOML for a dependency list on Python 3.10,
    which has no tomllib (3.11+ uses tomllib)."""
    body = re.search(rf"^\[{re.escape(table)}\][ \t]*$(.*?)(?=^\[|\Z)", text, re.S | re.M)
    if body is None:
        raise ValueError(f"no [{table}] table")
    start = re.search(rf"^{re.escape(key)}\s*=\s*\[", body.group(1), re.M)
    if start is None:
        raise ValueError(f"no {key} = [...] in [{table}]")
    out, i, rest = [], 0, body.group(1)[start.end():]
    while rest[i] != "]":  # items, commas, whitespace and comments up to the closing bracket
        if rest[i] == "#":
            i = rest.index("\n", i)
        elif rest[i] in "\"'":
            end = rest.index(rest[i], i + 1)
            out.append(rest[i + 1:end])
            i = end + 1
        else:
            i += 1
    return out


def project_dependencies(pyproject: Path = PYPROJECT) -> list[str]:
    """``[project].dependencies`` of pyproject.toml: the one list of what relax needs at run time.

    Inside a task container only the code may have travelled (fast registration); there the
    installed relax's metadata answers, or nothing does, which is fine: the image is built already.
    """
    if not pyproject.is_file():
        from importlib import metadata

        try:
            return [r for r in metadata.requires("relax") or [] if "extra ==" not in r]
        except metadata.PackageNotFoundError:
            return []
    text = pyproject.read_text()
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        return _toml_string_array(text, "project", "dependencies")
    return list(tomllib.loads(text)["project"]["dependencies"])


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;@(]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def image_packages(dependencies: list[str] | None = None) -> list[str]:
    """The ImageSpec's packages: pyproject's dependencies with torch pinned (first) and megatron-core."""
    deps = project_dependencies() if dependencies is None else dependencies
    # torch first and pinned: an unpinned torch pulls whatever CUDA build pip resolves today
    return [TORCH, *(d for d in deps if _name(d) != "torch"), MEGATRON]


RELAX_IMAGE = ImageSpec(
    name="relax",
    python_version="3.11",
    packages=image_packages(),
    cuda=os.environ.get("RELAX_IMAGE_CUDA") or None,  # e.g. "12.8" for GPU nodes; unset = CPU image
    registry=os.environ.get("RELAX_IMAGE_REGISTRY") or None,
    env={"RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
)

def task_image() -> ImageSpec | None:
    """The ImageSpec when a registry is configured (flytekit builds it at registration), else None:
    the task then runs in the image given to ``pyflyte register/package --image``."""
    return RELAX_IMAGE if RELAX_IMAGE.registry else None
