"""Child processes that die with the process that started them, so none is left orphaned.

The kernel sends a process SIGTERM when its parent dies once it has asked with
PR_SET_PDEATHSIG. A child asks itself, after its exec (:func:`die_with_launcher`), never in a
``preexec_fn``: with one, ``subprocess`` must fork() rather than vfork(), and a fork of a process
whose gRPC threads are busy runs gRPC's fork handlers, which crash the child before its exec now
and then (grpc/grpc#43062: a gateway that ``llmesh up`` started died with ``Check failed:
wakeup_fd_->ConsumeWakeup().ok()`` before its first line; measured here, 81 of 300 children of a
process answering gRPC calls crashed with a ``preexec_fn``, none without)."""

from __future__ import annotations

import ctypes
import os
import signal
from collections.abc import Mapping

PARENT_ENV = "LLMESH_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def die_with(parent: int) -> None:
    """The kernel sends this process SIGTERM when ``parent``, the process (its thread) that started
    it, ends; it exits at once if that one already died before this took effect (the kernel then
    gave this process another parent)."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:
        os._exit(0)


def with_parent(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` for a child that is to die with this process: it calls :func:`die_with_launcher`."""
    return {**env, PARENT_ENV: str(os.getpid())}


def die_with_launcher() -> None:
    """In a process started with :func:`with_parent`'s environment: dies with that parent, and
    exits at once if the parent already died before this took effect. The variable is removed,
    so this process's own children do not take its parent for theirs."""
    parent = os.environ.pop(PARENT_ENV, None)
    if parent is not None:
        die_with(int(parent))
