"""Builds gpt2ffn._C, the packed-weight CPU kernels (src/gpt2ffn/csrc), with torch's cpp_extension.

The extension is optional: where it cannot be built (no C++ compiler, a platform that is not x86-64),
the install goes on without it and gpt2ffn runs every precision on torch's own ops (gpt2ffn.kernels.native
says why). Everything else about the package is in pyproject.toml.
"""

import platform
import sys

from setuptools import setup

ext_modules, cmdclass = [], {}
if platform.machine().lower() in ("x86_64", "amd64"):
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    class OptionalBuild(BuildExtension):
        """BuildExtension that warns and carries on when the compiler fails."""

        def run(self):
            try:
                super().run()
            except Exception as e:  # noqa: BLE001 - any build failure leaves the torch fallback
                print(f"gpt2ffn: the C++ kernels were not built ({e}); torch's ops will be used", file=sys.stderr)

    src = "src/gpt2ffn/csrc/"
    # -ffp-contract=off: a * b + c stays two roundings, as written (g++ fuses them by default, -std=c++20 or not):
    # the kernels' FMAs are the explicit ones, so every build computes the same IEEE operations.
    files = ("ops.cpp", "linear_avx512.cpp", "linear_avx2.cpp", "qlinear_avx512.cpp", "qlinear_avx2.cpp",
             "qlinear_avxvnni.cpp", "qlinear_amx.cpp")
    headers = ("linear.h", "linear_impl.h", "qlinear_impl.h", "act_impl.h", "vec_avx512.h", "vec_avx2.h",
               "qvec_avx2.h")  # a changed header rebuilds the extension (setuptools looks at the sources only)
    ext_modules = [CppExtension("gpt2ffn._C", [src + f for f in files], depends=[src + h for h in headers],
                                extra_compile_args=["-O3", "-fopenmp", "-ffp-contract=off"],
                                extra_link_args=["-fopenmp"])]
    cmdclass = {"build_ext": OptionalBuild.with_options(use_ninja=False)}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
