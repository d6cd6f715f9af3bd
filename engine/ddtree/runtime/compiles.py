"""Triton kernel compilations of this process, as they happen.

A Triton kernel is compiled (or loaded from Triton's disk cache) the first time the process launches it
with a new specialization: new constexprs (block sizes derived from a token count), or an integer argument
that changes class (divisible by 16 or not). Each costs a request the time to first token it lands in, so
the engine runs every shape a request can meet at start-up (`Engine.warm_up`, graph capture) and the smoke
test fails if its fast path still compiles anything; the server counts later ones in
`ddtree_kernel_compiles_total`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

_listeners: list[Callable[[str], None]] = []
_installed = False


def _install() -> bool:
    """Chain our hook into Triton's jit cache hook (called on every in-process cache miss); False without
    Triton."""
    global _installed
    if _installed:
        return True
    try:
        from triton import knobs
    except ImportError:
        return False
    previous = knobs.runtime.jit_cache_hook

    def hook(*args, **kwargs):
        for listener in list(_listeners):
            listener(kwargs["repr"])
        # a true result would tell Triton to skip the compilation
        return previous(*args, **kwargs) if previous is not None else False

    knobs.runtime.jit_cache_hook = hook
    _installed = True
    return True


def on_compile(listener: Callable[[str], None]) -> None:
    """Call `listener(description)` for every kernel compiled from now on (no-op without Triton)."""
    if _install():
        _listeners.append(listener)


@contextmanager
def recording() -> Iterator[list[str]]:
    """The kernels compiled while the block runs, as Triton describes them (name and specialization)."""
    compiled: list[str] = []
    on_compile(compiled.append)
    try:
        yield compiled
    finally:
        if compiled.append in _listeners:
            _listeners.remove(compiled.append)
