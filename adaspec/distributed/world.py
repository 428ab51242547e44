"""The ranks a sharded target spans, the collectives that cross them, and the watchdog that
ends a rank whose peers stop answering (an mlx collective waits forever on a hung peer)."""

from __future__ import annotations

import logging
import os
import socket
import statistics
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ..errors import DistributedError

log = logging.getLogger(__name__)

ESTABLISHED, CLOSE_WAIT = b"\x01", b"\x08"  # tcp_info.tcpi_state
EXIT_LOST = 3  # exit code of a rank that lost its peers (watchdog or a closed connection)


def backend_name() -> str:
    """Which launcher started this process, from the environment it sets."""
    if os.environ.get("MLX_HOSTFILE") or os.environ.get("MLX_RANK"):
        return "ring"
    if os.environ.get("OMPI_COMM_WORLD_SIZE") or os.environ.get("PMI_SIZE"):
        return "mpi"
    return "none"


class Watchdog:
    """Ends this process when an armed wait outlives `timeout` seconds. Armed by each
    collective the rank issues and refreshed by the next; disarmed once a synchronous
    collective proves every earlier one finished. Ends with os._exit: a thread blocked inside
    an mlx collective cannot be interrupted any other way."""

    def __init__(self, timeout: float, rank: int, gone: Callable[[], bool] = lambda: False):
        self.timeout = timeout
        self.rank = rank
        self.gone = gone  # whether a peer's connection is closed (it died): no need to wait
        self.closed = False  # set once this rank is done with its peers
        self._since: float | None = None
        self._what = ""
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._watch, name="adaspec-watchdog", daemon=True)
        self._thread.start()

    def arm(self, what: str) -> None:
        with self._lock:
            self._since, self._what = time.monotonic(), what

    def disarm(self) -> None:
        with self._lock:
            self._since = None

    @contextmanager
    def waiting(self, what: str) -> Iterator[None]:
        """Armed for the block; disarmed after it (the block ends in a synchronous wait)."""
        self.arm(what)
        try:
            yield
        finally:
            self.disarm()

    def _watch(self) -> None:
        while not self.closed:
            time.sleep(min(0.5, self.timeout / 4))
            with self._lock:
                since, what = self._since, self._what
            if self.closed:
                return
            if self.gone():
                self._end(f"a peer closed its connection (it died or was killed) ({what})")
            if since is not None and time.monotonic() - since > self.timeout:
                self._end(
                    f"no answer from the other ranks for {self.timeout:g} s while {what}; a "
                    f"peer hangs or the network is down (ADASPEC_DIST_TIMEOUT={self.timeout:g})"
                )

    def _end(self, why: str) -> None:
        sys.stderr.write(f"adaspec: rank {self.rank}: {why}; ending this rank\n")
        sys.stderr.flush()
        os._exit(EXIT_LOST)


@dataclass
class World:
    """This process's place among the ranks: `group` is the mx.distributed group (None alone)."""

    group: Any
    rank: int
    size: int
    backend: str
    watchdog: Watchdog | None = None
    collectives: int = 0  # collectives this rank has queued (commands, pipeline hops, taps)
    _sockets: list[int] = field(default_factory=list)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def done(self) -> None:
        """This rank is finished with its peers: their connections may close now."""
        if self.watchdog:
            self.watchdog.closed = True

    def lost(self, what: str, exc: BaseException) -> DistributedError:
        return DistributedError(
            f"rank {self.rank} of {self.size} lost its peers while {what}: {exc}; another rank "
            "died or closed its connection (its own error, if any, is printed above)"
        )

    @contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """A synchronous wait on collectives: watched, and a lost peer raises DistributedError."""
        ctx = self.watchdog.waiting(what) if self.watchdog else _nothing()
        try:
            with ctx:
                yield
        except RuntimeError as exc:
            if "ring" in str(exc) or "peer" in str(exc) or "MPI" in str(exc):
                raise self.lost(what, exc) from exc
            raise

    def wire_bytes(self) -> tuple[int, int]:
        """(bytes sent, bytes received) so far on the connections to the other ranks, as the
        kernel counts them (TCP_INFO): what crossed the network, TCP's own headers aside."""
        sent = recv = 0
        for info in map(_tcp_info, self._sockets):
            if len(info) >= 136:
                acked, received = struct.unpack_from("QQ", info, 120)
                sent, recv = sent + acked, recv + received
        return sent, recv

    def peer_gone(self) -> bool:
        """Whether another rank closed its end of a connection (TCP CLOSE_WAIT)."""
        return any(info[:1] == CLOSE_WAIT for info in map(_tcp_info, self._sockets))


def _tcp_info(fd: int) -> bytes:
    try:
        s = socket.socket(fileno=os.dup(fd))
    except OSError:
        return b""
    try:
        return s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 160)
    except OSError:
        return b""
    finally:
        s.close()


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def _tcp_fds() -> list[int]:
    """This process's socket descriptors that are TCP (the ring backend's connections)."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
        except OSError:
            continue
        fd = int(name)
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if s.type == socket.SOCK_STREAM and s.family in (socket.AF_INET, socket.AF_INET6):
                out.append(fd)
        finally:
            s.close()
    return out


_WORLD: World | None = None


def world(timeout: float | None = None) -> World:
    """The world this process runs in: one rank unless started by mlx.launch or mpirun. The
    first call joins the group (every rank must call it) and starts the watchdog."""
    global _WORLD
    if _WORLD is not None:
        return _WORLD
    backend = backend_name()
    if backend == "none":
        _WORLD = World(None, 0, 1, backend)
        return _WORLD
    import mlx.core as mx

    group = mx.distributed.init(strict=True, backend=backend)
    if timeout is None:
        from ..settings import get

        timeout = get().dist_timeout
    w = World(group, group.rank(), group.size(), backend)
    # the connections init opened to the other ranks
    w._sockets = [fd for fd in _tcp_fds() if _tcp_info(fd)[:1] == ESTABLISHED]
    if w.size > 1:
        w.watchdog = Watchdog(timeout, w.rank, w.peer_gone)
    _WORLD = w
    log.info("rank %d of %d (%s backend)", w.rank, w.size, backend)
    return w


def network_report(w: World, repeats: int = 20) -> dict[str, Any]:
    """The ranks, the backend and (when there are several) the measured median time of one
    all_sum round trip at a command's size and at a 16-row hidden state's; every rank must
    call it together."""
    out: dict[str, Any] = {"ranks": w.size, "backend": w.backend, "rank": w.rank}
    if w.size == 1:
        return out
    import mlx.core as mx

    warm = 30  # the first collectives of a connection are much slower
    for name, n in (("round_trip_us_384B", 96), ("round_trip_us_36KB", 9216)):
        x = mx.zeros((n,), mx.int32)
        times = []
        with w.guard("measuring the network"):
            for _ in range(repeats + warm):
                t0 = time.perf_counter()
                mx.eval(mx.distributed.all_sum(x, group=w.group))
                times.append(time.perf_counter() - t0)
        out[name] = round(statistics.median(times[warm:]) * 1e6, 1)
    return out
