"""The split executor and the worker's share in one process: the verifier's side on this thread, the
worker's on another, meeting in a sync area in plain memory, with no message between them."""

import threading

import pytest
import torch

from actors.executor import SplitExecutor, WorkerShare, plan_split
from actors.syncarea import STOP, Abandoned, Clock, SyncArea
from actors.tracing import Tracer
from models import split_attention
from models.attention import Visibility
from models.requests import NeedWeights
from models.transformer import Transformer
from formats.weights import TensorWeights, random_tensors
from models.requests import weights_for

ROWS, CTX = 16, 70
PARENTS = [-1, 0, 0, 1, 2, 2, 3, 4, 5]


def _clock(timeout_s=10.0, interrupted=lambda: False):
    return Clock("the sparse worker", timeout_s, interrupted, lambda: None, 1.0)


def _slots(a, rows=ROWS):
    maxc = -(-(rows + 2 * 32) // 32)
    n = {
        "sync": SyncArea.nbytes(rows),
        "q": rows * a.q_dim * 4,
        "ch": rows * a.n_heads * maxc * (a.head_dim + 2) * 4,
        "x": rows * a.dim * 4,
        "xin": rows * max(a.dim, a.q_dim, a.ffn_dim) * 4,
        "y": rows * max(a.q_dim + 2 * a.kv_dim, 2 * a.ffn_dim) * 4,
    }
    return {k: torch.zeros(v, dtype=torch.uint8) for k, v in n.items()}


def _model(args):
    model = Transformer(args, TensorWeights(args, random_tensors(args, 0), "int4"))
    if not model.fused:
        pytest.skip("the split runs on the fused CPU path")
    return model


def _context(model):
    """A cache holding CTX committed tokens, and the tree's tokens, positions and visibility after them."""
    cache = model.new_cache(CTX + ROWS)
    g = torch.Generator().manual_seed(3)
    model.forward(torch.randint(0, model.args.vocab_size, (CTX,), generator=g), torch.arange(CTX), cache)
    cache.commit()
    ids = torch.randint(0, model.args.vocab_size, (len(PARENTS),), generator=g)
    vis = Visibility.tree(CTX, PARENTS)
    return cache, ids, vis.depths(), vis


def _split_forward(model, ex, ids, pos, cache, vis):
    """What the verifier actor does with a job: weights from the provider, split requests to the executor."""
    steps = model.forward_steps(ids, pos, cache, vis, plan=ex.plan(vis))
    need = next(steps)
    try:
        while True:
            need = steps.send(weights_for(model.weights, need) if isinstance(need, NeedWeights) else ex.answer(need))
    except StopIteration as done:
        return done.value


@pytest.mark.parametrize(
    "share, columns", [(0.0, 0.0), (0.5, 0.0), (0.5, 0.3)], ids=["attention", "dense share", "columns"]
)
def test_a_forward_split_with_the_worker_is_bit_for_bit_the_unsplit_one(tiny_args, share, columns):
    model = _model(tiny_args)
    cache, ids, pos, vis = _context(model)
    ref = model.forward(ids, pos, cache, vis)
    cache.rewind(cache.length)  # the pending entries again
    slots = _slots(tiny_args)
    worker = WorkerShare(tiny_args, cache, model.weights.layers, SyncArea(slots["sync"], ROWS), slots, Tracer(False))
    served = []
    t = threading.Thread(target=lambda: served.append(worker.serve(7, _clock())))
    t.start()
    ex = SplitExecutor(model, share, columns, Tracer(False))
    ex.begin(7, ROWS, slots, _clock())
    try:
        out = _split_forward(model, ex, ids, pos, cache, vis)
        ex.end()
    finally:
        ex.abandon()
        t.join(10)
    assert torch.equal(out, ref)
    assert served == [1]


def test_a_plan_gives_the_worker_fewer_dense_chunks_when_its_states_would_not_fit(tiny_args):
    vis = Visibility.tree(1000, PARENTS)
    a = tiny_args
    free = plan_split(vis, a, 0.5, 0.0, 1.0)
    room = len(PARENTS) * a.n_heads * 4 * (a.head_dim + 2)  # 4 chunk states a row
    tight = plan_split(vis, a, 0.5, 0.0, 1.0, room)
    assert free.maxc > 4 and tight.maxc <= 4 and tight.k0 > free.k0 and tight.k0 % split_attention.CHUNK == 0


def test_a_worker_that_fails_ends_the_verifiers_wait_at_once(tiny_args):
    model = _model(tiny_args)
    cache, ids, pos, vis = _context(model)
    slots = _slots(tiny_args)
    worker = WorkerShare(tiny_args, cache, None, SyncArea(slots["sync"], ROWS), slots, Tracer(False))  # no layers
    errors = []

    def serve():
        try:
            worker.serve(1, _clock())
        except RuntimeError as e:
            errors.append(str(e))

    t = threading.Thread(target=serve)
    t.start()
    ex = SplitExecutor(model, 0.0, 0.3, Tracer(False))
    ex.begin(1, ROWS, slots, _clock())
    with pytest.raises(Abandoned, match="the sparse worker gave up job 1 before layer 0's qkv columns"):
        _split_forward(model, ex, ids, pos, cache, vis)
    t.join(10)
    assert "--column-share" in errors[0]


def test_a_verifier_that_gives_up_ends_the_workers_wait(tiny_args):
    model = _model(tiny_args)
    cache, ids, pos, vis = _context(model)
    slots = _slots(tiny_args)
    worker = WorkerShare(tiny_args, cache, model.weights.layers, SyncArea(slots["sync"], ROWS), slots, Tracer(False))
    ex = SplitExecutor(model, 0.0, 0.0, Tracer(False))
    ex.begin(2, ROWS, slots, _clock())
    ex.plan(vis)
    ex.abandon()
    with pytest.raises(Abandoned, match="gave up job 2"):
        worker.serve(2, Clock("the verifier", 10.0, lambda: False, lambda: None, 1.0))


def test_every_wait_ends_on_its_deadline_a_stop_or_a_message(tiny_args):
    model = _model(tiny_args)
    cache, ids, pos, vis = _context(model)
    slots = _slots(tiny_args)
    ex = SplitExecutor(model, 0.0, 0.0, Tracer(False))
    ex.begin(3, ROWS, slots, _clock(timeout_s=0.2))
    with pytest.raises(TimeoutError, match="the sparse worker did not finish layer 0's attention within 0.2 s"):
        _split_forward(model, ex, ids, pos, cache, vis)
    cache.rewind(cache.length)
    ex.begin(4, ROWS, slots, _clock())
    SyncArea(slots["sync"], ROWS).words[STOP] = 4  # what the scheduler writes when an actor dies
    with pytest.raises(Abandoned, match="the scheduler stopped job 4"):
        _split_forward(model, ex, ids, pos, cache, vis)
    cache.rewind(cache.length)
    ex.begin(5, ROWS, slots, _clock(interrupted=lambda: True))  # a STOP (or the next request) on the socket
    with pytest.raises(Abandoned, match="a message arrived"):
        _split_forward(model, ex, ids, pos, cache, vis)
