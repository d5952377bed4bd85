"""The whole DLRM training step under ``torch.compile(backend="tpu", fullgraph=True)``
against the same step run eagerly: SparseCore lookups with their fused-optimizer
backward stay in the graph, and the loss, the dense gradients, the dense
optimizer step (compiled too) and the embedding tables all match eager."""

import pytest
import torch

import sparsecore
from data.loader import Batch
from models.dlrm import DLRMTrain
from models.train import dense_parameters
from tests.models.test_dlrm import BATCH, batch, build_pair, make_data


def training_step(model, optimizer, compiled: bool):
    forward, update = model, optimizer.step
    if compiled:
        forward = torch.compile(model, backend="tpu", fullgraph=True)
        update = torch.compile(optimizer.step, backend="tpu")

    def step(data):
        loss, _ = forward(data)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        update()
        return loss.detach()

    return step


def tpu_batches(source, ebc, count: int) -> list[Batch]:
    """The first ``count`` weighted multi-hot batches, preprocessed by ``ebc``, dense parts on tpu."""
    out = []
    for start in range(0, count * BATCH, BATCH):
        dense, kjt, labels = batch(source, start, weighted=True)
        out.append(Batch(dense=dense, sparse=ebc.preprocess(kjt), labels=labels).to("tpu"))
    return out


def trained(kind: str, source, compiled: bool):
    """Three training steps: the losses, the last gradients, the state."""
    _, model = build_pair(kind, source, optimizer=sparsecore.optim.Adam(lr=0.05), weighted=True)
    optimizer = torch.optim.Adam(dense_parameters(model), lr=0.01, capturable=True)
    step = training_step(DLRMTrain(model), optimizer, compiled)
    batches = tpu_batches(source, model.sparse_arch.embedding_bag_collection, 3)
    with torch.tpu.precision("highest"):
        losses = [step(b).cpu() for b in batches]
    grads = {n: p.grad.cpu() for n, p in model.named_parameters() if p.grad is not None}
    return losses, grads, {k: v.cpu() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("kind", ["dlrm", "dcn"])
def test_compiled_training_step_equals_eager(kind):
    source = make_data(multi_hot=True)
    eager_losses, eager_grads, eager_state = trained(kind, source, compiled=False)
    losses, grads, state = trained(kind, source, compiled=True)
    torch.testing.assert_close(torch.stack(losses), torch.stack(eager_losses), atol=1e-5, rtol=1e-5)
    assert len(set(float(x) for x in losses)) == 3  # each step trained on what the last one changed
    assert grads.keys() == eager_grads.keys() and grads
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], atol=1e-5, rtol=1e-4, msg=name)
    tables = [k for k in state if k.startswith("sparse_arch.")]
    assert tables
    for key, value in state.items():  # dense weights and tables after three steps
        torch.testing.assert_close(value, eager_state[key], atol=1e-5, rtol=1e-4, msg=key)


def test_the_benchmarks_compiled_step_under_defer_and_fuse_equals_compiled_strict():
    """benchmarks.compile's DLRM_DCN step (fullgraph forward with the SparseCore
    lookups, compiled plain Adam) under DeferAndFuse: the compiled graphs are sync
    points run with the mode off - the backward's too, which AOTAutograd compiles at
    its first call, inside autograd; that compile runs with the mode off as well
    (before, the mode recorded its ops on fake tensors and the next graph failed)."""
    import torch_tpu
    from benchmarks.compile import WORKLOADS, dlrm_make_step
    from torch_tpu import defer

    def dense_after_three_steps(mode: str) -> list[torch.Tensor]:
        torch._dynamo.reset()
        step, _ = dlrm_make_step(WORKLOADS["dlrm_train_step"], "tpu compiled")
        with torch.tpu.precision("highest"), torch_tpu.eager_mode(mode):
            for _ in range(3):
                step()
            torch.tpu.synchronize()
        optimizer = step.__closure__[step.__code__.co_freevars.index("optimizer")].cell_contents
        return [p.detach().cpu() for group in optimizer.param_groups for p in group["params"]]

    strict = dense_after_three_steps("strict")
    defer.reset_stats()
    deferred = dense_after_three_steps("defer_and_fuse")
    assert defer.stats().materialized_by["torch.compile graph"] > 0, defer.stats()
    assert len(strict) == len(deferred) > 0
    for a, b in zip(strict, deferred):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)


def test_new_batches_do_not_recompile_the_step():
    """Batches of other sizes (entries per SparseCore) share padded buffer shapes
    (sparsecore.preprocess.bucket_width) and the step reads no Python state that changes
    per batch (partition statistics), so a compiled step traces once."""
    from torch._dynamo.utils import counters

    source = make_data(multi_hot=True)
    _, model = build_pair("dcn", source, optimizer=sparsecore.optim.Adagrad(lr=0.05), weighted=True)
    optimizer = torch.optim.SGD(dense_parameters(model), lr=0.1)
    step = training_step(DLRMTrain(model), optimizer, compiled=True)
    ebc = model.sparse_arch.embedding_bag_collection
    batches = tpu_batches(source, ebc, 4)
    stacks = [b.sparse.stacks for b in batches]
    assert len({sum(int((s.sample_ids >= 0).sum()) for s in batch_stacks.values()) for batch_stacks in stacks}) > 1
    assert len({tuple(s.gains.shape for s in batch_stacks.values()) for batch_stacks in stacks}) == 1
    step(batches[0])
    graphs = counters["stats"]["unique_graphs"]
    for b in batches[1:]:
        step(b)
    assert counters["stats"]["unique_graphs"] == graphs
    assert ebc.observed_limits()  # still recorded: by preprocess, outside the graph
