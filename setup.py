"""Builds Speculant's native CPU kernels (src/speculant/native/kernels.c) with the system C
compiler during `pip install`. Everything else lives in pyproject.toml.

The kernels are optional: when no compiler is available the build still succeeds and
Speculant runs its PyTorch paths, saying so when a model loads."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "speculant._kernels",
            sources=["src/speculant/native/kernels.c"],
            depends=["src/speculant/native/tiles.h"],
            define_macros=[("SPEC_PYTHON_MODULE", "1")],
            # -ffp-contract=off: no fused multiply-adds behind our back, so the portable
            # and the vector paths round identically (tests compare them bitwise).
            extra_compile_args=["-O3", "-std=gnu11", "-ffp-contract=off", "-pthread"],
            extra_link_args=["-pthread"],
            optional=True,
        )
    ]
)
