"""Rank 0 decides, every rank computes: rank 0's target broadcasts each operation (new cache,
prefill, verify forward, rollback, an mlx-lm AR run) before running it; the other ranks
receive it and run the same operation on their slice of the model. Nothing is inferred apart:
the tokens fed and the positions rolled back are rank 0's."""

from __future__ import annotations

import json
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any, cast

import mlx.core as mx

from ..errors import DistributedError, TargetError
from ..targets.base import Forward, TargetInfo, layer_list, layer_output, spying
from ..targets.kv import KVTarget
from .shard import Sharding, _Stage
from .world import World

# the fixed command every operation starts with (int32): op, target id, n, a, taps, ids
HEADER = 96
TAPS = 8
FIXED = 5 + TAPS
SLOTS = HEADER - FIXED  # ids carried in the header itself (a verify's, a plain step's)
NEW, PREFILL, FORWARD, ROLLBACK, AR, SYNC, STOP = range(1, 8)
OP_NAMES = {
    NEW: "opening a cache",
    PREFILL: "prefilling",
    FORWARD: "verifying",
    ROLLBACK: "rolling back",
    AR: "running mlx-lm's AR",
    SYNC: "synchronizing",
    STOP: "stopping",
}


class ShardedKV(KVTarget):
    """One rank's slice of a sharded target: tap features of layers another rank runs are
    gathered from it, so every rank holds every tap."""

    def __init__(self, model: Any, tokenizer: Any, sharding: Sharding, world: World, **kw: Any):
        super().__init__(model, tokenizer, **kw)
        self.sharding, self.world = sharding, world
        self.info: TargetInfo = replace(self.info, num_layers=sharding.num_layers)
        self.tree_unsupported = "sharded over ranks"

    def run(self, tokens: Sequence[int] | mx.array, taps: tuple[int, ...]) -> tuple[mx.array, list]:
        if not taps or self.sharding.kind == "tensor":  # tensor: every rank has every layer
            return super().run(tokens, taps)
        x = tokens if isinstance(tokens, mx.array) else mx.array(list(tokens), dtype=mx.uint32)
        x = x.astype(mx.uint32)[None]
        layers = layer_list(self.model)
        local = [(t, self.sharding.local(t)) for t in taps]
        mine = [(t, i) for t, i in local if i is not None]
        slots = [
            (layers[i], "layer") if isinstance(layers[i], _Stage) else (layers, i) for _, i in mine
        ]
        with spying(slots) as spies:
            logits = self.model(x, cache=self.cache)[0]
        n, h = x.shape[1], self.info.hidden_size
        got = {t: layer_output(s).astype(mx.float32) for (t, _), s in zip(mine, spies)}
        parts = [got.get(t, mx.zeros((n, h), dtype=mx.float32)) for t in taps]
        # gathered after the pipeline's own gather on every rank (the logits depend on it)
        mine_all = mx.depends(mx.concatenate(parts, axis=-1), logits)
        every = mx.distributed.all_gather(mine_all, group=self.world.group)
        self.world.collectives += 1
        owners = [self.sharding.owner(t) for t in taps]
        return logits, [
            every[o * n : (o + 1) * n, j * h : (j + 1) * h] for j, o in enumerate(owners)
        ]


def _ints(a: mx.array) -> list[int]:
    """A 1-D integer array's values (mlx types tolist() as any nesting of lists or a scalar)."""
    return cast(list[int], a.tolist())


def _header(op: int, tid: int, n: int = 0, a: int = 0, taps: Sequence[int] = (), ids=None):
    if len(taps) > TAPS:
        raise DistributedError(f"{len(taps)} tap layers; accepted on a sharded target: <= {TAPS}")
    fixed = mx.array([op, tid, n, a, len(taps), *taps, *[0] * (TAPS - len(taps))], mx.int32)
    parts = [fixed]
    if ids is not None:
        parts.append(ids.astype(mx.int32))
    parts.append(mx.zeros((HEADER - FIXED - (0 if ids is None else n),), mx.int32))
    return mx.concatenate(parts)


class Channel:
    """The commands rank 0 sends: each a broadcast (an all_sum to which the others add zeros)
    of one fixed header, plus the ids or JSON that do not fit in it."""

    def __init__(self, world: World):
        self.world = world

    def _bcast(self, x: mx.array) -> mx.array:
        self.world.collectives += 1
        return mx.distributed.all_sum(x, group=self.world.group)

    def send(self, op: int, tid: int, n: int = 0, a: int = 0, taps=(), ids=None, sync=True):
        """Broadcast a command; with `sync`, wait until every rank has it (which also proves
        every earlier collective done). Returns the header as received (lazy without sync)."""
        inline = ids is not None and n <= SLOTS
        a = self._with_trim(op, tid, a)
        hdr = self._bcast(_header(op, tid, n, a, taps, ids if inline else None))
        if ids is not None and not inline:  # the ids that do not fit follow the header
            with self.world.guard(OP_NAMES[op]):
                # after the header on every rank: two collectives of one evaluation are
                # ordered only by their dependencies
                mx.eval(self._bcast(mx.depends(ids.astype(mx.int32), hdr)))
        elif sync:
            with self.world.guard(OP_NAMES[op]):
                mx.eval(hdr)
        else:
            mx.async_eval(hdr)
            if self.world.watchdog:
                self.world.watchdog.arm(OP_NAMES[op])
        return hdr

    def _with_trim(self, op: int, tid: int, a: int) -> int:
        """A rollback waits for the next command: a prefill or verify of the same cache carries
        it (field a: positions to trim first); any other command is preceded by it."""
        return a

    def send_json(self, op: int, tid: int, obj: Any) -> None:
        raw = json.dumps(obj).encode()
        self.send(op, tid, n=len(raw), ids=mx.array(list(raw), dtype=mx.int32))

    def receive(self) -> tuple[int, int, int, int, tuple[int, ...], mx.array]:
        """(op, target id, n, a, taps, ids) of rank 0's next command (waits as long as rank 0
        takes: it may be idle, so only a lost connection ends the wait)."""
        g = self.world.group
        try:
            hdr = mx.distributed.all_sum(mx.zeros((HEADER,), mx.int32), group=g)
            mx.eval(hdr)
            op, tid, n, a, nt = _ints(hdr[:5])
            ids = hdr[FIXED : FIXED + n]
            if n > SLOTS:
                zeros = mx.depends(mx.zeros((n,), mx.int32), hdr)
                ids = mx.distributed.all_sum(zeros, group=g)
                mx.eval(ids)
        except RuntimeError as exc:
            raise self.world.lost("waiting for rank 0's next command", exc) from exc
        return op, tid, n, a, tuple(_ints(hdr[5 : 5 + nt])), ids


def local_target(model: Any, tokenizer: Any, world: World, prefill_step: int) -> ShardedKV:
    from .shard import sharding

    s = sharding(model)
    if s is None:
        raise DistributedError("the model is not sharded; accepted: a model passed to shard()")
    return ShardedKV(model, tokenizer, s, world, prefill_step=prefill_step)


class LeaderTarget:
    """Rank 0's target: every operation is broadcast, then run on rank 0's own slice."""

    rollback_kind = "trim"
    tree_unsupported = "sharded over ranks"

    def __init__(self, model: Any, tokenizer: Any, world: World, prefill_step: int):
        self.world, self.channel = world, _channel(world)
        self.local = local_target(model, tokenizer, world, prefill_step)
        self.info = self.local.info
        self._last: list[mx.array] | None = None  # the latest forward's outputs
        dead = self.channel.forget_dead()
        self.tid = self.channel.open(self)
        self.channel.send(NEW, self.tid, len(dead), prefill_step, ids=mx.array(dead, mx.int32))

    @property
    def offset(self) -> int:
        return self.local.offset

    def prefill(self, tokens: Sequence[int], taps: tuple[int, ...] = ()) -> mx.array | None:
        ids = mx.array([int(t) for t in tokens], dtype=mx.int32)
        self.channel.send(PREFILL, self.tid, len(tokens), 0, taps, ids)
        self._last = None
        with self.world.guard(OP_NAMES[PREFILL]):
            return self.local.prefill(tokens, taps)

    def forward(self, tokens: Sequence[int] | mx.array, taps: tuple[int, ...] = ()) -> Forward:
        ids = tokens if isinstance(tokens, mx.array) else mx.array([int(t) for t in tokens])
        n = ids.shape[0]
        hdr = self.channel.send(FORWARD, self.tid, n, 0, taps, ids, sync=False)
        fed = hdr[FIXED : FIXED + n] if n <= SLOTS else ids
        fwd = self.local.forward(fed.astype(mx.uint32), taps)
        # queued now, in the order every rank builds it: the collectives inside must match
        self._last = [fwd.logits, *([] if fwd.features is None else [fwd.features])]
        mx.async_eval(*self._last)
        return fwd

    def rollback(self, n: int) -> None:
        """Trims rank 0's caches now and the others' with the next command (no collective of
        its own). The controller rolls back after reading the verify, so waiting for that
        forward here costs nothing and proves every collective so far done (the watchdog
        stands down until the next command)."""
        self.local.rollback(n)  # a bad n raises here, before any rank hears of it
        self.channel.trim(self, n)
        if self._last is not None:
            with self.world.guard(OP_NAMES[FORWARD]):
                mx.eval(*self._last)

    def forward_tree(self, tokens, parents, taps=()) -> Forward:
        raise TargetError(f"this target verifies chains only: {self.tree_unsupported}")

    def keep_path(self, path) -> None:
        raise TargetError(f"this target verifies chains only: {self.tree_unsupported}")


class _LeaderChannel(Channel):
    """Rank 0's channel: numbers its targets and tells the others which are gone."""

    def __init__(self, world: World):
        super().__init__(world)
        self._next = 1
        self._live: dict[int, weakref.ref] = {}
        self._trim = (0, 0)  # (cache id, positions) rank 0 trimmed and the others not yet

    def trim(self, target: LeaderTarget, n: int) -> None:
        tid, pending = self._trim
        if pending and tid != target.tid:
            self._flush()
        self._trim = (target.tid, self._trim[1] + n if tid == target.tid else n)

    def _flush(self) -> None:
        tid, pending = self._trim
        self._trim = (0, 0)
        if pending:
            self.send(ROLLBACK, tid, 0, pending, sync=False)

    def _with_trim(self, op: int, tid: int, a: int) -> int:
        pending_tid, pending = self._trim
        if not pending:
            return a
        if op in (FORWARD, PREFILL) and pending_tid == tid:
            self._trim = (0, 0)
            return pending
        self._flush()
        return a

    def open(self, target: LeaderTarget) -> int:
        tid, self._next = self._next, self._next + 1
        self._live[tid] = weakref.ref(target)
        return tid

    def forget_dead(self) -> list[int]:
        dead = [t for t, r in self._live.items() if r() is None][:SLOTS]
        for t in dead:
            del self._live[t]
        return dead


_CHANNELS: dict[int, _LeaderChannel] = {}


def _channel(world: World) -> _LeaderChannel:
    return _CHANNELS.setdefault(id(world), _LeaderChannel(world))


def mirrored_ar(
    model: Any, tokenizer: Any, ids: Sequence[int], max_tokens: int, sampling: dict
) -> Iterator[Any]:
    """mlx-lm's own stream_generate on `model`; on a sharded model every rank runs it (its
    collectives inside), started by a broadcast command. Always runs to its end, so that
    every rank stops at the same token."""
    from .shard import sharding
    from .world import world as get_world

    w = get_world()
    if sharding(model) is not None and w.size > 1:
        ch = _channel(w)
        ch.send_json(AR, 0, {"ids": list(map(int, ids)), "max_tokens": max_tokens, **sampling})
    gen = _ar(model, tokenizer, list(map(int, ids)), max_tokens, sampling)
    try:
        for r in gen:
            if w.watchdog:
                w.watchdog.arm(OP_NAMES[AR])
            yield r
    finally:
        for _ in gen:  # the consumer stopped early: the other ranks run on to the end
            pass
        if sharding(model) is not None and w.size > 1:
            _channel(w).send(SYNC, 0)


def _ar(model: Any, tokenizer: Any, ids: list[int], max_tokens: int, kw: dict) -> Iterator[Any]:
    import mlx_lm

    from ..sampling_params import mlx_lm_sampler

    if kw.get("seed") is not None:
        mx.random.seed(int(kw["seed"]))
    smp = mlx_lm_sampler(kw)
    from mlx_lm.generate import generation_stream

    try:
        yield from mlx_lm.stream_generate(model, tokenizer, ids, max_tokens=max_tokens, sampler=smp)
    finally:
        # mlx-lm queues a step past its last token on its own stream; its collectives must
        # finish before the next command's, which run on the default stream
        mx.synchronize(generation_stream)


def follow(model: Any, tokenizer: Any, world: World) -> int:
    """A rank other than 0: run rank 0's commands on this rank's slice until it stops."""
    ch = Channel(world)
    targets: dict[int, ShardedKV] = {}
    while True:
        op, tid, n, a, taps, ids = ch.receive()
        with world.guard(OP_NAMES.get(op, f"command {op}")):
            if op == STOP:
                world.done()
                return 0
            if op == NEW:
                for dead in _ints(ids):
                    targets.pop(dead, None)
                targets[tid] = local_target(model, tokenizer, world, a)
            elif op == PREFILL:
                targets[tid].rollback(a)  # a rollback rank 0 made since the last command
                targets[tid].prefill(_ints(ids), taps)
            elif op == FORWARD:
                targets[tid].rollback(a)
                fwd = targets[tid].forward(ids.astype(mx.uint32), taps)
                mx.eval(fwd.logits, *([] if fwd.features is None else [fwd.features]))
            elif op == ROLLBACK:
                targets[tid].rollback(a)
            elif op == AR:
                kw = json.loads(bytes(_ints(ids)).decode())
                for _ in _ar(model, tokenizer, kw.pop("ids"), kw.pop("max_tokens"), kw):
                    if world.watchdog:
                        world.watchdog.arm(OP_NAMES[AR])
            elif op != SYNC:
                raise DistributedError(f"rank {world.rank} got unknown command {op} from rank 0")


def stop(world: World) -> None:
    """Rank 0 is done: the other ranks leave their loops."""
    if world.size > 1 and world.leader:
        _channel(world).send(STOP, 0)
        world.done()


def leader_target(model: Any, tokenizer: Any, prefill_step: int) -> LeaderTarget:
    """The target for a sharded model (distributed.target_for): rank 0's mirrored target."""
    from .world import world as get_world

    w = get_world()
    if not w.leader:
        raise DistributedError(
            f"rank {w.rank} builds no target of its own; accepted: rank 0 generates, the other "
            "ranks run adaspec.distributed.follow()"
        )
    return LeaderTarget(model, tokenizer, w, prefill_step)
