"""Parse server flags with SGLang's own ``ServerArgs`` parser; print the parsed values as JSON.

Run as a script with ``PYTHONPATH=.venv/sglang-parser`` (installed by infra/setup.sh, --no-deps):
``python sglang_parser.py --model-path m --tp-size 2 ...``. An unknown flag or a bad value
makes SGLang's argparse exit 2 with its own message. SGLang's utilities import triton (a GPU
compiler that does not install here) at module level; the parser never calls it, so an
import hook hands out empty modules under that name and nothing else.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import json
import sys
import types


class _Empty(types.ModuleType):
    """A module whose every attribute is another empty module, callable as a no-op decorator."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        child = _Empty(f"{self.__name__}.{name}")
        sys.modules[child.__name__] = child
        return child

    def __call__(self, *args, **kwargs):
        return args[0] if args and callable(args[0]) else self


class _NoTriton(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name == "triton" or name.startswith("triton."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _Empty(spec.name)

    def exec_module(self, module):
        module.__path__ = []


def main() -> None:
    sys.meta_path.insert(0, _NoTriton())
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang.launch_server")
    ServerArgs.add_cli_args(parser)
    parsed = parser.parse_args(sys.argv[1:])
    print(json.dumps({k: v for k, v in vars(parsed).items() if isinstance(v, (str, int, float, bool))}))


if __name__ == "__main__":
    main()
