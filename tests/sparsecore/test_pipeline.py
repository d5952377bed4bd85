"""sparsecore.TrainPipeline: the same numbers as the plain loop, with the sparse work overlapped.

The reference is the plain loop (zero_grad, forward, backward, step per batch)
on an identically built model: after 10 steps the tables, the fused optimizer
state, the dense weights and their optimizer state are equal, bit for bit, and
so is every step's loss. Two-rank pipelines (every sharding type, DDP and
FSDP2) are checked against the single-process plain loop in
tests/models/test_distributed_train.py.
"""

import itertools
import threading

import pytest
import torch
from torchrec import EmbeddingBagConfig

import sparsecore
from data import schema
from data.loader import Batch, BatchLoader
from data.synthetic import SyntheticConfig, SyntheticCriteo
from models.dlrm import DLRM, DLRMTrain
from models.train import dense_parameters
from sparsecore.executor import executor_for
from sparsecore.trace import StageTrace

BATCH, DIM, STEPS = 128, 8, 10
# The fused optimizer steps in the backward, so its scheduler steps with no optimizer.step() before it.
pytestmark = pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")


def loader(preprocessor=None) -> list[Batch]:
    source = SyntheticCriteo(SyntheticConfig(scale=1e-5, num_samples=STEPS * BATCH, multi_hot=True, seed=5))
    return list(BatchLoader(source, BATCH, shuffle=False, preprocessor=preprocessor)), source.table_sizes


def build(sizes, embedding_optimizer, seed=0):
    limit = BATCH * 200
    tables = [sparsecore.SparseCoreEmbeddingConfig(
        config=EmbeddingBagConfig(name=f"t_{f}", num_embeddings=n, embedding_dim=DIM, feature_names=[f]),
        max_ids_per_partition=limit, max_unique_ids_per_partition=limit)
        for f, n in zip(schema.SPARSE_NAMES, sizes)]
    torch.manual_seed(seed)
    ebc = sparsecore.SparseCoreEmbeddingBagCollection(tables, embedding_optimizer, device="tpu")
    model = DLRMTrain(DLRM(ebc, schema.NUM_DENSE, [16, DIM], [16, 1]).to("tpu"))
    return model, torch.optim.Adam(dense_parameters(model.model), lr=0.01)


def schedulers(model):
    """An LR schedule on the fused optimizer: every step changes the lr the next update uses."""
    return torch.optim.lr_scheduler.StepLR(model.model.sparse_arch.embedding_bag_collection.fused_optimizer,
                                           step_size=1, gamma=0.7)


def plain_loop(model, opt, batches, scheduler):
    losses = []
    for batch in batches:
        loss, _ = model(batch.to("tpu"))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        scheduler.step()
        losses.append(loss.item())
    return losses


def pipelined(model, opt, batches, scheduler, trace=None):
    pipeline = sparsecore.TrainPipeline(model, opt, "tpu", trace=trace)
    it = iter(batches)
    losses = []
    while True:
        try:
            loss, _, _ = pipeline.progress(it)
        except StopIteration:
            break
        scheduler.step()
        losses.append(loss.item())
    return losses, pipeline


def assert_same_state(a, b):
    for key, value in a.state_dict().items():
        torch.testing.assert_close(b.state_dict()[key].cpu(), value.cpu(), rtol=0, atol=0, msg=key)
    ebc_a = a.model.sparse_arch.embedding_bag_collection
    ebc_b = b.model.sparse_arch.embedding_bag_collection
    sa, sb = ebc_a.fused_optimizer.state_dict()["state"], ebc_b.fused_optimizer.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for key in sa:
        for name in sa[key]:
            torch.testing.assert_close(sb[key][name].cpu(), sa[key][name].cpu(), rtol=0, atol=0, msg=f"{key}.{name}")


@pytest.mark.parametrize("optimizer", [sparsecore.optim.RowWiseAdagrad(lr=0.1), sparsecore.optim.Adam(lr=0.01)],
                         ids=["rowwise_adagrad", "adam"])
def test_pipeline_trains_exactly_as_the_plain_loop(optimizer):
    batches, sizes = loader()
    ref, ref_opt = build(sizes, optimizer)
    ours, ours_opt = build(sizes, optimizer)
    expected = plain_loop(ref, ref_opt, batches, schedulers(ref))
    trace = StageTrace()
    got, _ = pipelined(ours, ours_opt, batches, schedulers(ours), trace)
    assert len(got) == STEPS
    assert got == expected
    assert_same_state(ref, ours)
    for key, value in ref_opt.state_dict()["state"].items():
        for name, tensor in value.items():
            torch.testing.assert_close(ours_opt.state_dict()["state"][key][name].cpu(), tensor.cpu(), rtol=0, atol=0)
    # The sparse work ran where the pipeline puts it: every update and lookup on the executor.
    stages = {(i.lane, i.stage) for i in trace.intervals}
    assert {("sparsecore", "sparse update"), ("sparsecore", "lookup"), ("main", "backward")} <= stages
    assert sum(1 for i in trace.intervals if i.stage == "sparse update") == STEPS


def test_an_lr_change_after_progress_does_not_reach_the_queued_update():
    """The update of step i, still queued when progress returns, uses step i's learning rate."""
    batches, sizes = loader()
    ref, ref_opt = build(sizes, sparsecore.optim.SGD(lr=0.5))
    ours, ours_opt = build(sizes, sparsecore.optim.SGD(lr=0.5))
    expected = plain_loop(ref, ref_opt, batches[:4], schedulers(ref))
    pipeline = sparsecore.TrainPipeline(ours, ours_opt, "tpu")
    scheduler = schedulers(ours)
    executor = executor_for("tpu")
    it = iter(batches[:4])
    got = []
    for step in range(4):
        gate = threading.Event()
        if step:  # (step 0 looks its batch up after the gate: it would wait for it)
            executor.submit(gate.wait, 10)  # holds back what this step queues: its update runs after the lr change
        loss, _, _ = pipeline.progress(it)
        scheduler.step()
        gate.set()
        got.append(loss.item())
    assert got == expected
    assert_same_state(ref, ours)


def test_pipeline_takes_batches_preprocessed_by_the_loader():
    probe, _ = build(loader()[1], sparsecore.optim.SGD(lr=0.1))
    preprocessor = probe.model.sparse_arch.embedding_bag_collection.preprocessor()
    batches, sizes = loader(preprocessor)
    assert isinstance(batches[0].sparse, sparsecore.PreprocessedBatch)
    ref, ref_opt = build(sizes, sparsecore.optim.SGD(lr=0.1))
    ours, ours_opt = build(sizes, sparsecore.optim.SGD(lr=0.1))
    assert pipelined(ours, ours_opt, batches, schedulers(ours))[0] == plain_loop(ref, ref_opt, batches, schedulers(ref))
    assert_same_state(ref, ours)


def test_stop_iteration_and_a_new_iterator_restarts():
    batches, sizes = loader()
    model, opt = build(sizes, sparsecore.optim.SGD(lr=0.1))
    pipeline = sparsecore.TrainPipeline(model, opt, "tpu")
    first = iter(batches[:3])
    outputs = [pipeline.progress(first) for _ in range(3)]
    assert [len(o[1]) for o in outputs] == [BATCH] * 3
    with pytest.raises(StopIteration):
        pipeline.progress(first)
    with pytest.raises(StopIteration):
        pipeline.progress(first)
    pipeline.progress(iter(batches[3:4]))  # a new iterator: starts again


def test_reading_weights_waits_for_the_deferred_update():
    batches, sizes = loader()
    model, opt = build(sizes, sparsecore.optim.SGD(lr=0.5))
    ebc = model.model.sparse_arch.embedding_bag_collection
    before = ebc.state_dict()
    pipeline = sparsecore.TrainPipeline(model, opt, "tpu")
    pipeline.progress(itertools.chain(batches[:1]))
    after = ebc.state_dict()  # no explicit synchronize: the read waits for the queued update
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed, "the step's update is not visible to a reader"


def test_bad_models_and_batches_are_named():
    with pytest.raises(ValueError, match="no SparseCore embedding collection"):
        sparsecore.TrainPipeline(torch.nn.Linear(2, 2), torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1),
                                 "tpu")
    batches, sizes = loader()
    model, opt = build(sizes, sparsecore.optim.SGD(lr=0.1))
    pipeline = sparsecore.TrainPipeline(model, opt, "tpu")
    with pytest.raises(TypeError, match="sparse features of a tuple"):
        pipeline.progress(iter([(1, 2)]))


def drawn_from(batches, log):
    """Yields the batches, logging (index, thread) at each draw."""
    for i, batch in enumerate(batches):
        log.append((i, threading.get_ident()))
        yield batch


@pytest.mark.parametrize("read_ahead", [True, False], ids=["read_ahead", "on_the_loop"])
def test_the_iterator_is_read_in_order_by_a_thread_of_its_own_two_batches_ahead(read_ahead):
    batches, sizes = loader()
    ref, ref_opt = build(sizes, sparsecore.optim.SGD(lr=0.1))
    ours, ours_opt = build(sizes, sparsecore.optim.SGD(lr=0.1))
    expected = plain_loop(ref, ref_opt, batches, schedulers(ref))
    pipeline = sparsecore.TrainPipeline(ours, ours_opt, "tpu", read_ahead=read_ahead)
    scheduler, log, ahead, got = schedulers(ours), [], [], []
    it = drawn_from(batches, log)
    for step in range(STEPS):
        loss, _, _ = pipeline.progress(it)
        scheduler.step()
        got.append(loss.item())
        ahead.append(len(log) - 1 - step)  # batches drawn past the one just trained
    pipeline.close()
    assert got == expected
    assert_same_state(ref, ours)
    assert [i for i, _ in log] == list(range(STEPS))
    main = threading.get_ident()
    if read_ahead:
        assert all(thread != main for _, thread in log)
        assert max(ahead) <= 2 and ahead[0] >= 1, ahead
    else:
        assert all(thread == main for _, thread in log)
        assert max(ahead) == 1, ahead


@pytest.mark.parametrize("read_ahead", [True, False], ids=["read_ahead", "on_the_loop"])
def test_an_error_of_the_iterator_comes_out_of_the_step_that_fetches_its_batch(read_ahead):
    # Then, as on a generator that raised, the iteration is over: the next step trains the batch
    # fetched before the error (it hung on the stopped reader thread), the one after ends.
    batches, sizes = loader()
    ref, ref_opt = build(sizes, sparsecore.optim.SGD(lr=0.1))
    ours, ours_opt = build(sizes, sparsecore.optim.SGD(lr=0.1))
    expected = plain_loop(ref, ref_opt, batches[:3], schedulers(ref))

    def failing():
        yield from batches[:3]
        raise ValueError("line 384: 41 fields, expected 40")

    pipeline = sparsecore.TrainPipeline(ours, ours_opt, "tpu", read_ahead=read_ahead)
    scheduler, it, got = schedulers(ours), failing(), []
    for _ in range(2):
        loss, _, _ = pipeline.progress(it)  # step i fetches batch i + 1
        scheduler.step()
        got.append(loss.item())
    with pytest.raises(ValueError, match="line 384"):
        pipeline.progress(it)  # trains nothing: batch 2's step would fetch the bad batch 3 first
    got.append(pipeline.progress(it)[0].item())
    with pytest.raises(StopIteration):
        pipeline.progress(it)
    pipeline.close()
    assert got == expected
    assert_same_state(ref, ours)


def reading_pipeline():
    """A pipeline one step into its batches, its reader waiting to hand over the next."""
    batches, sizes = loader()
    model, opt = build(sizes, sparsecore.optim.SGD(lr=0.1))
    pipeline = sparsecore.TrainPipeline(model, opt, "tpu")
    pipeline.progress(iter(batches))
    return pipeline, batches


def test_a_new_iterator_and_close_stop_the_reader():
    pipeline, batches = reading_pipeline()
    first = pipeline._reader._thread
    assert first.is_alive()  # blocked on the batch it read ahead
    for _ in range(2):
        pipeline.progress(iter(batches[:2]))
    assert not first.is_alive() and pipeline._reader._thread is not first
    pipeline.close()
    assert pipeline._reader is None
    assert not any(t.name == "sparsecore-pipeline-reader" and t.is_alive() for t in threading.enumerate())


def test_a_pipeline_dropped_without_close_stops_its_reader():
    import gc

    pipeline, _ = reading_pipeline()
    thread = pipeline._reader._thread
    pipeline.synchronize()
    del pipeline
    gc.collect()
    thread.join(5)
    assert not thread.is_alive()


def test_pipeline_steps_under_defer_and_fuse_run_dormant_with_the_plain_loops_numbers(monkeypatch):
    """Each progress() ends in torch.tpu.mark_step(): under DeferAndFuse a host boundary,
    so the step - cut into segments inside the SparseCore kernels - can run dormant as a
    chain, from one step's end to the next (forced here: every segment and chain chooses
    to). The numbers stay the plain Strict loop's, bit for bit."""
    import torch_tpu
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from tests.test_defer_and_fuse import segments_chosen_eager
    from torch_tpu import defer, defer_segments, deferred_graph

    monkeypatch.setenv("TORCH_TPU_DEFER_COMPILE", "off")
    monkeypatch.setattr(defer.engine(), "graphs", deferred_graph.GraphCache())
    monkeypatch.setattr(defer.engine(), "segments", defer_segments.Segments(defer.engine().segments.max_ops))
    segments_chosen_eager(monkeypatch)
    batches, sizes = loader()
    batches = batches * 2
    optimizer = sparsecore.optim.RowWiseAdagrad(lr=0.1)
    ref, ref_opt = build(sizes, optimizer)
    ours, ours_opt = build(sizes, optimizer)
    expected = plain_loop(ref, ref_opt, batches, schedulers(ref))
    pipeline, scheduler = sparsecore.TrainPipeline(ours, ours_opt, "tpu"), schedulers(ours)
    it = iter(batches)
    losses, away = [], []
    with torch_tpu.eager_mode("defer_and_fuse"):
        for _ in batches:
            loss, _, _ = pipeline.progress(it)
            away.append(not any(isinstance(m, defer.DeferAndFuse) for m in _get_current_dispatch_mode_stack()))
            scheduler.step()
            losses.append(loss.item())
        pipeline.synchronize()
    (chain,) = defer.engine().segments.chains  # the step's segments, cut at the SparseCore kernels
    assert len(chain) >= 2, chain
    assert away[-8:] == [True] * 8, away
    assert losses == expected
    assert_same_state(ref, ours)
