"""Ahead-of-time compilation of Triton kernels for sm_90a without a GPU (ptxas and cuobjdump ship with
Triton): what the compile tests of the kernel modules share."""

from __future__ import annotations

import pathlib
import subprocess

import pytest


def compile_sm90(fn, consts: dict, types: dict | None = None, pointer="bf16", warps=4, stages=3, divisible=False):
    """`fn` compiled for sm_90a with the constexprs `consts`; the other arguments typed by `types`, else as
    pointers to `pointer` (names ending in _ptr) or i64. divisible: every pointer and integer argument
    divisible by 16, as Triton specialises them at run time when they are (it changes the SASS). A kernel
    with a PDL constexpr is compiled with it on, as kernels.pdl() launches it on sm_90."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    types = types or {}
    if "PDL" in fn.arg_names:
        consts = {"PDL": True} | consts
    sig = {
        n: "constexpr" if n in consts else types.get(n, f"*{pointer}" if n.endswith("_ptr") else "i64")
        for n in fn.arg_names
    }
    attrs = None
    if divisible:
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if sig[n][0] in "*i"}
    src = ASTSource(fn, sig, consts, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))


def tool(name: str) -> pathlib.Path:
    """One of the NVIDIA tools that ship with Triton (ptxas, cuobjdump)."""
    triton = pytest.importorskip("triton")
    return pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name


def sass(kernel, cubin: pathlib.Path) -> str:
    """A compiled kernel's SASS (its cubin written to `cubin`)."""
    cubin.write_bytes(kernel.asm["cubin"])
    out = subprocess.run([str(tool("cuobjdump")), "-sass", str(cubin)], capture_output=True, text=True, check=True)
    return out.stdout
