"""Package discovery (the rest is in pyproject.toml): every package under eagle3_gguf/, and the top-level
convert/ folder installed as eagle3_gguf.convert (pyproject's package-dir), with its subpackages."""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["eagle3_gguf", "eagle3_gguf.*"]),
                *(f"eagle3_gguf.{name}" for name in find_packages(include=["convert", "convert.*"]))])
