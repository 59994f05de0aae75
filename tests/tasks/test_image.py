"""The container's packages come from pyproject.toml, not from a second list that drifts."""

from __future__ import annotations

import re
from pathlib import Path

from packaging.requirements import Requirement

from tasks import image

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest's own tomli
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
DEPENDENCIES = PYPROJECT["project"]["dependencies"]


def _pin(requirement: str) -> tuple[str, str]:
    req = Requirement(requirement)
    (spec,) = req.specifier
    assert spec.operator == "==", requirement
    return req.name, spec.version


def test_the_image_spec_installs_pyprojects_dependencies():
    packages = image.RELAX_IMAGE.packages
    torch, megatron = packages[0], packages[-1]
    assert (torch, megatron) == (image.TORCH, image.MEGATRON)
    # everything else is pyproject's list itself, in its order; torch is the pin, not the range
    assert packages[1:-1] == [d for d in DEPENDENCIES if Requirement(d).name != "torch"]
    assert "python-dateutil<3" in packages
    # the pins are versions that pyproject allows
    (torch_range,) = [Requirement(d) for d in DEPENDENCIES if Requirement(d).name == "torch"]
    assert torch_range.specifier.contains(_pin(image.TORCH)[1])
    (megatron_range,) = [Requirement(d) for d in PYPROJECT["project"]["optional-dependencies"]["megatron"]]
    assert megatron_range.specifier.contains(_pin(image.MEGATRON)[1])


def test_the_python_310_fallback_reads_the_same_list():
    text = (REPO / "pyproject.toml").read_text()
    assert image._toml_string_array(text, "project", "dependencies") == DEPENDENCIES
    tricky = ('[project]\nname = "x"\ndependencies = [\n  "a>=1",  # a comment, with "quotes" and a ]\n'
              "  'b[c]<2',\n]\n\n[other]\ndependencies = [\"z\"]\n")
    assert image._toml_string_array(tricky, "project", "dependencies") == ["a>=1", "b[c]<2"]
    assert image.project_dependencies(REPO / "pyproject.toml") == DEPENDENCIES


def test_the_dockerfile_installs_the_project_and_lists_no_dependency():
    dockerfile = (REPO / "infra" / "Dockerfile").read_text()
    installs = re.findall(r"pip install ([^\n\\&]*)", dockerfile)
    assert any(re.fullmatch(r"--no-cache-dir \.\s*", args) for args in installs), installs
    listed = {Requirement(d).name for d in DEPENDENCIES} - {"torch"}  # sglang pins its own torch first
    for args in installs:
        named = {re.split(r"[\[<>=!~]", w.strip("\"'"))[0] for w in args.split() if not w.startswith("-")}
        assert not named & listed, f"the Dockerfile re-lists {sorted(named & listed)}: pip install . has them"


def test_every_pin_of_torch_and_megatron_agrees():
    dockerfile = (REPO / "infra" / "Dockerfile").read_text()
    setup = (REPO / "infra" / "setup.sh").read_text()
    megatron = _pin(image.MEGATRON)[1]
    assert re.search(r"^ARG MEGATRON_VERSION=(\S+)$", dockerfile, re.M).group(1) == megatron
    assert re.search(r'"megatron-core==([^"]+)"', setup).group(1) == megatron
    assert re.search(r"TORCH_VERSION:-([^}]+)\}", setup).group(1) == _pin(image.TORCH)[1]
