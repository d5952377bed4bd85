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
