"""The SparseCore executor: a tpu stream whose work overlaps TensorCore work."""

import time

import pytest
import torch
from torchrec import EmbeddingBagConfig

from sparsecore import optim
from sparsecore.config import SparseCoreEmbeddingConfig
from sparsecore.executor import executor_for
from sparsecore.modules import SparseCoreEmbeddingBagCollection
from tests.sparsecore.test_modules import TABLES, random_kjt


def test_forward_async_equals_forward_and_synchronize_waits():
    engine = SparseCoreEmbeddingBagCollection(TABLES, device="tpu")
    kjt = random_kjt(TABLES, batch=8)
    future = engine.forward_async(kjt)
    torch.tpu.synchronize()
    assert future.done()
    torch.testing.assert_close(future.result().values().cpu(), engine(kjt).values().cpu())
    assert executor_for("tpu").stream.device_type == torch.tpu.current_stream().device_type


def test_forward_async_keeps_the_callers_grad_mode():
    engine = SparseCoreEmbeddingBagCollection(TABLES, optimizer=optim.SGD(lr=0.1), device="tpu")
    kjt = random_kjt(TABLES, batch=8)
    with torch.no_grad():
        assert not engine.forward_async(kjt).result(timeout=10).values().requires_grad
    assert engine.forward_async(kjt).result(timeout=10).values().requires_grad


def test_executor_work_is_ordered_and_errors_surface():
    ex = executor_for("tpu")
    seen = []
    ex.submit(time.sleep, 0.05)
    ex.submit(seen.append, 1)
    ex.submit(seen.append, 2)
    ex.synchronize()
    assert seen == [1, 2]
    engine = SparseCoreEmbeddingBagCollection(TABLES, device="tpu")
    bad = random_kjt(TABLES[:1], batch=2)  # lacks features
    try:
        engine.forward_async(bad).result(timeout=10)
        raise AssertionError("expected an InputError")
    except Exception as error:  # noqa: BLE001
        assert "lacks feature" in str(error)


def timed(fn) -> float:
    fn()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@pytest.mark.timing
def test_sparse_work_overlaps_dense_work():
    """Same thread counts (one each): overlapped wall time < the sum of both."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows, batch = 200_000, 4096
        table = [SparseCoreEmbeddingConfig(config=EmbeddingBagConfig(name="big", num_embeddings=rows, embedding_dim=64,
                                                                     feature_names=["f"]),
                                           max_ids_per_partition=batch * 20, max_unique_ids_per_partition=batch * 20)]
        engine = SparseCoreEmbeddingBagCollection(table, device="tpu")
        kjt = random_kjt([t.config for t in table], batch=batch, max_len=40)
        a = torch.randn(384, 384, device="tpu")
        repeats = 1

        def dense():
            for _ in range(repeats):
                a @ a
            torch.tpu.synchronize()

        def sparse():
            return engine(kjt)

        # Balance the two sides, so overlap has something to hide.
        dense_s, sparse_s = timed(dense), timed(sparse)
        repeats = max(1, round(sparse_s / dense_s))
        def sequential():
            sparse()
            dense()

        def overlapped():
            future = engine.forward_async(kjt)
            dense()
            future.result()

        # Best of three: a busy machine can only make overlap look worse.
        ratio = min(timed(overlapped) / timed(sequential) for _ in range(3))
        assert ratio < 0.85, ratio
    finally:
        torch.set_num_threads(previous)


# Batches of 512: 2048 bags, several threads' worth of kernel work.
BIG_BATCH_TABLES = [SparseCoreEmbeddingConfig(config=t, max_ids_per_partition=1 << 14,
                                              max_unique_ids_per_partition=1 << 14) for t in TABLES]


def _forward_in_child(engine, kjt, results) -> None:
    results.put(engine(kjt).values().tolist())  # plain data: a tensor's shared memory would leave with the child


def test_kernels_run_in_a_forked_child_after_the_parent_used_their_threads():
    """The kernels' worker threads do not survive fork; a child (a DataLoader worker
    preprocessing ahead) starts its own instead of waiting on the parent's."""
    engine = SparseCoreEmbeddingBagCollection(BIG_BATCH_TABLES, device="cpu")
    kjt = random_kjt(TABLES, batch=512)
    expected = engine(kjt).values()
    context = torch.multiprocessing.get_context("fork")
    results = context.Queue()
    child = context.Process(target=_forward_in_child, args=(engine, kjt, results))
    child.start()
    try:
        got = results.get(timeout=60)
    finally:
        child.join(timeout=10)
        if child.is_alive():
            child.kill()
    torch.testing.assert_close(torch.tensor(got), expected, rtol=0, atol=0)


def test_kernels_called_from_two_threads_at_once_give_each_its_result():
    """The executor's kernels and the calling thread's share the engine's threads."""
    cpu_engine = SparseCoreEmbeddingBagCollection(BIG_BATCH_TABLES, device="cpu")
    tpu_engine = SparseCoreEmbeddingBagCollection(BIG_BATCH_TABLES, device="tpu")
    batches = [random_kjt(TABLES, batch=512, seed=s) for s in range(6)]
    expected_cpu = [cpu_engine(b).values() for b in batches]
    expected_tpu = [tpu_engine(b).values().cpu() for b in batches]
    pending = [tpu_engine.forward_async(b) for b in batches]
    on_main = [cpu_engine(b).values() for b in batches]
    for b in range(len(batches)):
        torch.testing.assert_close(on_main[b], expected_cpu[b], rtol=0, atol=0)
        torch.testing.assert_close(pending[b].result(timeout=60).values().cpu(), expected_tpu[b], rtol=0, atol=0)


# ---- deferred updates and the calling thread (an audit's cases) ----

BIG = [SparseCoreEmbeddingConfig(config=EmbeddingBagConfig(name="t", num_embeddings=2000, embedding_dim=64,
                                                           feature_names=["f"]),
                                 max_ids_per_partition=10**6, max_unique_ids_per_partition=10**6)]


def big_batches(n=4):
    return [random_kjt([BIG[0].config], batch=2048, seed=40 + i, max_len=20) for i in range(n)]


def trained(deferred: bool, after=None, optimizer=None):
    torch.manual_seed(0)
    engine = SparseCoreEmbeddingBagCollection(BIG, optimizer or optim.Adagrad(lr=0.01), device="tpu")
    engine.set_deferred_updates(deferred)
    for kjt in big_batches():
        engine(kjt).values().pow(2).sum().backward()  # the plain forward, after a queued update
    if after is not None:
        engine = after(engine)
    torch.tpu.synchronize()
    return engine


def test_a_plain_forward_sees_the_deferred_updates_queued_before_it():
    inline = trained(False).table_weight("t")
    assert torch.equal(trained(True).table_weight("t"), inline)


def test_turning_deferred_updates_off_waits_for_those_queued():
    inline = trained(False).table_weight("t")

    def off_then_read(engine):
        engine.set_deferred_updates(False)
        engine.read = engine.table_weight("t")  # once off, table_weight has no queue to wait for
        return engine

    assert torch.equal(trained(True, after=off_then_read).read, inline)


@pytest.mark.parametrize("how", ["to", "deepcopy"])
def test_a_copy_right_after_a_deferred_backward_has_its_update(how):
    import copy

    inline = trained(False)
    move = (lambda e: e.to("cpu")) if how == "to" else copy.deepcopy
    copied = trained(True, after=move)
    assert torch.equal(copied.table_weight("t").cpu(), inline.table_weight("t").cpu())
    for name, value in inline.table_optimizer_state("t").items():
        assert torch.equal(copied.table_optimizer_state("t")[name].cpu(), value.cpu())


def test_moving_to_the_device_the_module_is_on_keeps_its_optimizer():
    engine = SparseCoreEmbeddingBagCollection(TABLES, optim.Adagrad(lr=0.1), device="tpu")
    fused = engine.fused_optimizer
    scheduler = torch.optim.lr_scheduler.StepLR(fused, step_size=1, gamma=0.5)
    torch.nn.ModuleDict({"ebc": engine}).to("tpu")
    fused.step()
    scheduler.step()
    assert engine.fused_optimizer is fused and float(engine._hyper[0]) == pytest.approx(0.05)


@pytest.mark.parametrize("spec", [optim.Adagrad(lr=0.1), optim.Adam(lr=0.1), optim.RowWiseAdagrad(lr=0.1)])
def test_a_module_with_optimizer_state_pickles(spec):
    import io

    engine = SparseCoreEmbeddingBagCollection(TABLES, spec, device="tpu")
    engine(random_kjt(TABLES, batch=4, seed=2)).values().sum().backward()
    buffer = io.BytesIO()
    torch.save(engine, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for table in ("shared", "small"):
        for name, value in engine.table_optimizer_state(table).items():
            assert torch.equal(loaded.table_optimizer_state(table)[name].cpu(), value.cpu())
    kjt = random_kjt(TABLES, batch=4, seed=3)
    loaded(kjt).values().sum().backward()
    engine(kjt).values().sum().backward()
    assert torch.equal(loaded.table_weight("shared").cpu(), engine.table_weight("shared").cpu())

