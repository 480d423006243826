#!/usr/bin/env python
"""Write the bytecode (.pyc) of what oelm imports, once, at set-up.

pip installs with `--no-compile` (compiling every file of torch, jupyterlab and the rest costs about a minute of set-up),
so Python compiles a module the first time it is imported and keeps the .pyc for next time. Where the environment sets
PYTHONDONTWRITEBYTECODE (some CI images and sandboxes do), nothing is ever kept: every process compiles torch again
(measured on 2 cores: `import torch` 7.4 s instead of 3.0 s, `oelm --help` 13.9 s instead of 5.5 s), and a test suite
that starts a few hundred processes pays that each time. This script imports, with bytecode writing on, every module of
the package and the libraries its runs, reports, notebooks and tests load, so that their .pyc files exist; the Makefile
also unexports PYTHONDONTWRITEBYTECODE so whatever is imported later is compiled once too.

Usage: python tools/compile_imports.py [run|dev]   (run: what `make run` needs; dev: also tests, docs, Hugging Face)
"""
from __future__ import annotations
import importlib, pkgutil, sys, time, warnings

sys.dont_write_bytecode = False  # the point of this script, whatever PYTHONDONTWRITEBYTECODE says

RUN = ['torch', 'torch.distributed.run', 'numpy', 'scipy.stats', 'pandas', 'matplotlib.pyplot', 'seaborn', 'papermill',
       'ipykernel.kernelapp', 'ipykernel.ipkernel', 'nbconvert', 'nbformat', 'safetensors.torch', 'tokenizers', 'jsonargparse',
       'ipywidgets', 'tqdm']
DEV = ['pytest', 'xdist', 'hypothesis', 'nbdev', 'nbdev.test', 'nbdev.processors', 'execnb.shell', 'importlinter',
       'mkdocs', 'mkdocs_jupyter', 'submitit', 'transformers', 'peft', 'datasets', 'psutil', 'filelock']


def package_modules(name: str) -> list[str]:
    "Every module of package `name` (the package's own code: a few dozen modules)."
    pkg = importlib.import_module(name)
    return [m.name for m in pkgutil.walk_packages(pkg.__path__, name + '.')]


def main(kind: str = 'run') -> int:
    t0, failed = time.time(), []
    names = RUN + (DEV if kind == 'dev' else []) + package_modules('oelm_nb')
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        for name in names:
            try: importlib.import_module(name)
            except Exception as e: failed.append(f'{name} ({type(e).__name__})')  # an optional extra not installed
    print(f'[setup] bytecode written for {len(names) - len(failed)} modules and what they import ({time.time() - t0:.0f}s)'
          + (f'; not importable here: {", ".join(failed)}' if failed else ''))
    return 0


if __name__ == '__main__':
    sys.exit(main(*sys.argv[1:2]))
